"""Call an mhaserve server with tritonclient.grpc, unmodified, the way a Triton user would.

Runs in its own process: tritonclient registers the same protobuf messages (package inference) as
mhaserve's stubs, and one process cannot hold both. Usage:
    python triton_infer.py URL IN.npz OUT.npz sync|aio [OUTPUTS [APPLICATION]]
IN.npz holds case<i>_<input> arrays; OUT.npz gets case<i>_<output> for each of OUTPUTS (comma-separated,
default output,attn_weights), plus a 'metadata_shapes' and 'config_max_batch_size' entry read through
tritonclient. APPLICATION: the Ray Serve application, sent as 'application' metadata on every call.
$TRITON_PARAMETERS, if set, is a JSON object sent as every inference request's parameters.
"""

import asyncio
import json
import os
import sys

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
from tritonclient.utils import np_to_triton_dtype

OUTPUTS = ["output", "attn_weights"]
HEADERS = {}
PARAMETERS = json.loads(os.environ.get("TRITON_PARAMETERS", "null"))


def build(module, arrays):
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs, [module.InferRequestedOutput(name) for name in OUTPUTS]


def cases(data):
    grouped = {}
    for key in data.files:
        case, name = key.split("_", 1)
        grouped.setdefault(case, {})[name] = data[key]
    return grouped


def run_sync(url, grouped):
    client = grpcclient.InferenceServerClient(url)
    assert (
        client.is_server_live(HEADERS)
        and client.is_server_ready(HEADERS)
        and client.is_model_ready("mha", headers=HEADERS)
    )
    results = {}
    meta = client.get_model_metadata("mha", headers=HEADERS, as_json=True)
    results["metadata_shapes"] = np.array([int(d) for t in meta["inputs"] for d in t["shape"]])
    results["config_max_batch_size"] = np.array(
        client.get_model_config("mha", headers=HEADERS, as_json=True)["config"].get("max_batch_size", 0)
    )
    for case, arrays in grouped.items():
        inputs, outputs = build(grpcclient, arrays)
        result = client.infer("mha", inputs, outputs=outputs, headers=HEADERS, parameters=PARAMETERS)
        results.update({f"{case}_{name}": result.as_numpy(name) for name in OUTPUTS})
    stats = client.get_inference_statistics("mha", headers=HEADERS, as_json=True)
    results["inference_count"] = np.array(int(stats["model_stats"][0].get("inference_count", 0)))
    return results


async def run_aio(url, grouped):
    client = aioclient.InferenceServerClient(url)
    assert await client.is_model_ready("mha", headers=HEADERS)
    results = {}
    calls = {}
    for case, arrays in grouped.items():
        inputs, outputs = build(aioclient, arrays)
        calls[case] = client.infer("mha", inputs, outputs=outputs, headers=HEADERS, parameters=PARAMETERS)
    answers = await asyncio.gather(*calls.values())
    for case, result in zip(calls, answers, strict=True):
        results.update({f"{case}_{name}": result.as_numpy(name) for name in OUTPUTS})
    await client.close()
    return results


def main():
    url, path_in, path_out, mode = sys.argv[1:5]
    if len(sys.argv) > 5:
        OUTPUTS[:] = sys.argv[5].split(",")
    if len(sys.argv) > 6:
        HEADERS["application"] = sys.argv[6]
    grouped = cases(np.load(path_in))
    results = run_sync(url, grouped) if mode == "sync" else asyncio.run(run_aio(url, grouped))
    np.savez(path_out, **results)


if __name__ == "__main__":
    main()
