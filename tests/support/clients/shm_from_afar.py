"""Run on another host (tests/support/netns.py): every shared-memory call of both transports against the server
at GRPC_ADDRESS and HTTP_URL, and one plain inference. Prints {call: status} as JSON.

    python shm_from_afar.py GRPC_ADDRESS HTTP_URL D_MODEL KEY

KEY is a shared-memory object that exists, and a region "near" is registered already (from loopback): refused,
each call is refused for where it came from alone.
"""

import json
import sys
import urllib.error
import urllib.request

import grpc
import numpy as np

from mhaserve.client.grpc import build_infer_request
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

grpc_address, http_url, d_model, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
answers = {}


def grpc_call(name, method, request):
    try:
        method(request, timeout=10)
        answers[name] = "OK"
    except grpc.RpcError as error:
        answers[name] = error.code().name
        answers[name + " message"] = error.details()


def http_call(name, path, body=None):
    request = urllib.request.Request(http_url + path, None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            answers[name] = response.status
    except urllib.error.HTTPError as error:
        answers[name] = error.code
        answers[name + " message"] = json.load(error)["error"]


with grpc.insecure_channel(grpc_address) as channel:
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    query = np.ones((1, 2, d_model), np.float32)
    grpc_call("grpc plain infer", stub.ModelInfer, build_infer_request("mha", query))
    grpc_call(
        "grpc register",
        stub.SystemSharedMemoryRegister,
        pb.SystemSharedMemoryRegisterRequest(name="afar", key=key, offset=0, byte_size=64),
    )
    grpc_call("grpc status", stub.SystemSharedMemoryStatus, pb.SystemSharedMemoryStatusRequest())
    grpc_call("grpc unregister", stub.SystemSharedMemoryUnregister, pb.SystemSharedMemoryUnregisterRequest())
    placed = build_infer_request("mha", query)
    placed.outputs[0].parameters["shared_memory_region"].string_param = "near"
    placed.outputs[0].parameters["shared_memory_byte_size"].int64_param = 2 * d_model * 4
    grpc_call("grpc infer into shared memory", stub.ModelInfer, placed)
http_call("http register", "/v2/systemsharedmemory/region/afar/register", {"key": key, "offset": 0, "byte_size": 64})
http_call("http status", "/v2/systemsharedmemory/status")
http_call("http unregister", "/v2/systemsharedmemory/unregister", {})
http_call(
    "http infer into shared memory",
    "/v2/models/mha/infer",
    {
        "inputs": [{"name": "query", "shape": [1, 2, d_model], "datatype": "FP32", "data": [1.0] * (2 * d_model)}],
        "outputs": [
            {
                "name": "output",
                "parameters": {"shared_memory_region": "near", "shared_memory_byte_size": 2 * d_model * 4},
            }
        ],
    },
)
print(json.dumps(answers))
