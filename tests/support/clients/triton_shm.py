"""Call an mhaserve server through Triton's system shared-memory extension with tritonclient, unmodified, the
way a Triton user would: tritonclient.utils.shared_memory regions, registered over PROTOCOL, inputs read from
one region and outputs written into another; and the same requests over the socket, for comparison.

Runs in its own process (tritonclient.grpc's protobuf messages clash with mhaserve's). Usage:
    python triton_shm.py grpc|http URL IN.npz OUT.npz [OUTPUTS]
IN.npz holds case<i>_<input> arrays; OUT.npz gets, per case and output, <case>_<output>_shm (read from the
output region) and <case>_<output>_socket, plus 'status' (the regions the server listed while registered, as
JSON) and 'status_after' (after unregistering). $TRITON_TOKEN, if set, is sent as a bearer token.
"""

import json
import os
import sys

import numpy as np
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import np_to_triton_dtype, triton_to_np_dtype

TOKEN = os.environ.get("TRITON_TOKEN")
HEADERS = None


def main(protocol, url, path_in, path_out, outputs="output,attn_weights"):
    global HEADERS
    if protocol == "grpc":
        import tritonclient.grpc as module
    else:
        import tritonclient.http as module
    if TOKEN:  # gRPC metadata keys are lower case
        HEADERS = {("authorization" if protocol == "grpc" else "Authorization"): f"Bearer {TOKEN}"}
    client = module.InferenceServerClient(url)
    data = np.load(path_in)
    grouped = {}
    for key in data.files:
        case, name = key.split("_", 1)
        grouped.setdefault(case, {})[name] = data[key]
    names = outputs.split(",")
    results, statuses = {}, {}
    for case, arrays in grouped.items():
        socket_inputs = []
        for name, array in arrays.items():
            tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
            tensor.set_data_from_numpy(array)
            socket_inputs.append(tensor)
        socket = client.infer(
            "mha", socket_inputs, outputs=[module.InferRequestedOutput(n) for n in names], headers=headers()
        )
        results.update({f"{case}_{name}_socket": socket.as_numpy(name) for name in names})
        sizes = {name: socket.as_numpy(name).nbytes for name in names}
        in_size, out_size = sum(a.nbytes for a in arrays.values()), sum(sizes.values())
        in_key, out_key = f"/mhaserve_test_{os.getpid()}_{case}_in", f"/mhaserve_test_{os.getpid()}_{case}_out"
        in_region = shm.create_shared_memory_region(f"{case}_in", in_key, in_size)
        out_region = shm.create_shared_memory_region(f"{case}_out", out_key, out_size)
        try:
            shm.set_shared_memory_region(in_region, list(arrays.values()))
            client.register_system_shared_memory(f"{case}_in", in_key, in_size, headers=headers())
            client.register_system_shared_memory(f"{case}_out", out_key, out_size, headers=headers())
            statuses[case] = client.get_system_shared_memory_status(headers=headers(), **as_json(protocol))
            inputs, offset = [], 0
            for name, array in arrays.items():
                tensor = module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
                tensor.set_shared_memory(f"{case}_in", array.nbytes, offset)
                inputs.append(tensor)
                offset += array.nbytes
            requested, offsets, offset = [], {}, 0
            for name in names:
                output = module.InferRequestedOutput(name)
                output.set_shared_memory(f"{case}_out", sizes[name], offset)
                requested.append(output)
                offsets[name] = offset
                offset += sizes[name]
            result = client.infer("mha", inputs, outputs=requested, headers=headers())
            for name in names:
                answered = result.get_output(name)
                shape = list(answered.shape if protocol == "grpc" else answered["shape"])
                datatype = answered.datatype if protocol == "grpc" else answered["datatype"]
                array = shm.get_contents_as_numpy(out_region, triton_to_np_dtype(datatype), shape, offsets[name])
                results[f"{case}_{name}_shm"] = array.copy()
        finally:
            client.unregister_system_shared_memory(headers=headers())
            shm.destroy_shared_memory_region(in_region)
            shm.destroy_shared_memory_region(out_region)
    after = client.get_system_shared_memory_status(headers=headers(), **as_json(protocol))
    results["status"] = np.array(json.dumps(statuses))
    results["status_after"] = np.array(json.dumps(after))
    np.savez(path_out, **results)


def headers():
    """A fresh dict each call: tritonclient.http adds Inference-Header-Content-Length to the one it is given."""
    return dict(HEADERS) if HEADERS else None


def as_json(protocol):
    return {"as_json": True} if protocol == "grpc" else {}


if __name__ == "__main__":
    main(*sys.argv[1:])
