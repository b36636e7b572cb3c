"""Import tritonclient and mhaserve.client in one process, in the order given, and call one server with both.

    python both_clients.py triton-first|mhaserve-first GRPC_URL HTTP_URL

Prints JSON: each client's output for one query, over gRPC and over HTTP.
"""

import json
import sys

import numpy as np


def main():
    order, grpc_url, http_url = sys.argv[1:4]
    if order == "triton-first":
        import tritonclient.grpc as triton_grpc
        import tritonclient.http as triton_http

        from mhaserve.client import Client, HttpClient
    else:
        import tritonclient.grpc as triton_grpc
        import tritonclient.http as triton_http

        from mhaserve.client import Client, HttpClient
    query = np.random.default_rng(0).standard_normal((1, 3, int(sys.argv[4])), dtype=np.float32)
    answers = {}
    for name, module, url in (("grpc", triton_grpc, grpc_url), ("http", triton_http, http_url)):
        client = module.InferenceServerClient(url)
        given = module.InferInput("query", list(query.shape), "FP32")
        given.set_data_from_numpy(query)
        answers[f"triton-{name}"] = client.infer("mha", [given]).as_numpy("output").tolist()
    with Client(grpc_url) as client:
        answers["mhaserve-grpc"] = client.infer(query).output.tolist()
    with HttpClient(http_url) as client:
        answers["mhaserve-http"] = client.infer(query).output.tolist()
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
