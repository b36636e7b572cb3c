"""Drive an mhaserve server's model repository with tritonclient.grpc, unmodified, as a Triton user would.

Its own process, as triton_infer.py (tritonclient and mhaserve register the same protobuf messages).
Usage:
    python triton_repository.py URL STEPS.json RESULTS.json [TOKEN]
STEPS is a list of [call, *arguments]: ["index"], ["index_ready"], ["load", name], ["unload", name],
["ready", name, version], ["metadata", name, version], ["infer", name, version, query.npy, out.npy].
RESULTS gets one {"ok": bool, "status": "StatusCode.X" or "", "message": str, "value": ...} per step.
"""

import json
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype


def step(client, headers, call, *args):
    if call in ("index", "index_ready"):
        index = client.get_model_repository_index(headers=headers, as_json=True).get("models", [])
        if call == "index_ready":  # tritonclient has no 'ready' argument: the request by hand
            request = grpcclient.service_pb2.RepositoryIndexRequest(ready=True)
            response = client._client_stub.RepositoryIndex(request, metadata=client._get_metadata(headers))
            index = [{"name": m.name, "version": m.version, "state": m.state} for m in response.models]
        return index
    if call == "load":
        return client.load_model(args[0], headers=headers)
    if call == "unload":
        return client.unload_model(args[0], headers=headers)
    if call == "ready":
        return client.is_model_ready(args[0], args[1], headers=headers)
    if call == "metadata":
        meta = client.get_model_metadata(args[0], args[1], headers=headers, as_json=True)
        return {"versions": meta.get("versions", []), "query_shape": meta["inputs"][0]["shape"]}
    if call == "infer":
        name, version, query_path, out_path = args
        query = np.load(query_path)
        tensor = grpcclient.InferInput("query", list(query.shape), np_to_triton_dtype(query.dtype))
        tensor.set_data_from_numpy(query)
        result = client.infer(name, [tensor], model_version=version, headers=headers)
        np.save(out_path, result.as_numpy("output"))
        return result.get_response().model_version
    raise ValueError(call)


def main(url, steps_path, results_path, token=None):
    client = grpcclient.InferenceServerClient(url)
    headers = {"authorization": f"Bearer {token}"} if token else None
    results = []
    for call in json.load(open(steps_path)):
        try:
            value = step(client, headers, *call)
            results.append({"ok": True, "status": "", "message": "", "value": value})
        except InferenceServerException as error:
            results.append({"ok": False, "status": str(error.status()), "message": error.message(), "value": None})
    json.dump(results, open(results_path, "w"))


if __name__ == "__main__":
    main(*sys.argv[1:])
