"""Every request parameter of a wrong type is refused as a bad request naming it, over HTTP (400 with a JSON
error) and over gRPC (INVALID_ARGUMENT), never a server error; a client's long value is not echoed whole."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import build_infer_request
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support import SMALL_D_MODEL

QUERY = [0.5] * (2 * SMALL_D_MODEL)  # [1, 2, d]

# Values of every JSON type each parameter does not take.
WRONG_JSON = {
    "attn_top_k": [[4], {}, True, "four", 1.5],
    "attn_top_p": [[0.9], {}, True, "most", 2],
    "attn_heads": [[0], {}, True, 1.5, "zero"],
    "attn_rows": [[0, 1], {}, False, 0.5, "0-1"],
    "attn_keys": [[0, 1], {}, True, 2.5, "a:b"],
    "attn_weights_precision": [[16], {}, True, 16, "FP8"],
    "binary_data_output": [[1], {}, "yes", 1],
}


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


def infer_body(**fields) -> dict:
    return {"inputs": [{"name": "query", "shape": [1, 2, SMALL_D_MODEL], "datatype": "FP32", "data": QUERY}], **fields}


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.mark.parametrize(
    "name,value", [(name, value) for name, values in WRONG_JSON.items() for value in values], ids=repr
)
def test_a_parameter_of_a_wrong_json_type_is_400_naming_it(server, name, value):
    status, body = post(f"{server.http_url}/v2/models/mha/infer", infer_body(parameters={name: value}))
    assert status == 400, body
    assert name in body["error"], body


@pytest.mark.parametrize("value", [{"a": 1}, 7, ["x"], True])
def test_a_request_id_that_is_not_a_string_is_400(server, value):
    status, body = post(f"{server.http_url}/v2/models/mha/infer", infer_body(id=value))
    assert status == 400 and "'id' must be a string" in body["error"], body


# Each protobuf field of InferParameter a parameter does not take.
WRONG_PROTOBUF = {
    "attn_top_k": [("bool_param", True), ("double_param", 1.5), ("string_param", "four")],
    "attn_top_p": [("bool_param", True), ("string_param", "most"), ("int64_param", 2)],
    "attn_heads": [("bool_param", True), ("double_param", 1.5), ("string_param", "zero")],
    "attn_rows": [("bool_param", False), ("double_param", 0.5), ("int64_param", 1)],
    "attn_weights_precision": [("bool_param", True), ("int64_param", 16), ("double_param", 16.0)],
}


@pytest.mark.parametrize(
    "name,field,value",
    [(name, field, value) for name, wrong in WRONG_PROTOBUF.items() for field, value in wrong],
    ids=lambda v: str(v),
)
def test_a_parameter_of_a_wrong_protobuf_type_is_invalid_argument_naming_it(stub, name, field, value):
    request = build_infer_request("mha", np.full((1, 2, SMALL_D_MODEL), 0.5, np.float32))
    setattr(request.parameters[name], field, value)
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert name in error.value.details()


def test_a_long_value_comes_back_clipped_as_invalid_argument(stub, server):
    huge = "7," * 10_000  # 20 KB of head numbers
    request = build_infer_request("mha", np.full((1, 2, SMALL_D_MODEL), 0.5, np.float32))
    request.parameters["attn_heads"].string_param = huge
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "attn_heads" in error.value.details() and len(error.value.details()) < 400, error.value.details()
    status, body = post(f"{server.http_url}/v2/models/mha/infer", infer_body(parameters={"attn_heads": huge}))
    assert status == 400 and len(body["error"]) < 400, body


@pytest.mark.parametrize(
    "settings",
    [{"trace_rate": [[1]]}, {"trace_rate": {}}, {"trace_rate": True}, {"trace_rate": "often"},
     {"trace_rate": str(2**32)}, {"trace_count": str(2**31)}, {"trace_count": "-2"}, {"trace_level": [True]}],
    ids=repr,
)  # fmt: skip
def test_a_trace_setting_of_a_wrong_type_or_range_is_refused(server, stub, settings):
    status, body = post(f"{server.http_url}/v2/trace/setting", settings)
    assert status == 400 and next(iter(settings)) in body["error"], body
    name, value = next(iter(settings.items()))
    if isinstance(value, str):  # gRPC carries strings only
        request = pb.TraceSettingRequest()
        request.settings[name].value.append(value)
        with pytest.raises(grpc.RpcError) as error:
            stub.TraceSetting(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and name in error.value.details()


@pytest.mark.parametrize(
    "parameters",
    [{"sequence_id": [7]}, {"sequence_id": True}, {"sequence_id": 2**64}, {"sequence_id": 7, "sequence_start": "yes"},
     {"sequence_end": True}],
    ids=repr,
)  # fmt: skip
def test_sequence_parameters_of_a_wrong_type_are_400_naming_them(server, parameters):
    status, body = post(f"{server.http_url}/v2/models/mha/infer", infer_body(parameters=parameters))
    assert status == 400 and "sequence_" in body["error"], body


def test_no_bad_parameter_reached_the_servers_error_handler(server):
    # Run last in this module: every request above was refused as a bad request, none logged a traceback.
    assert "Traceback" not in server.log and "inference failed" not in server.log
