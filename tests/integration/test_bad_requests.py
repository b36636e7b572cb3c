"""Every malformed request gets a precise status naming the tensor, what was expected and what came;
the server keeps serving afterwards."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import build_infer_request
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support import SMALL_D_MODEL

D = SMALL_D_MODEL
INVALID, NOT_FOUND, EXHAUSTED = (
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
)


def q(b=1, n=4, d=D, value=0.5):
    return np.full((b, n, d), value, dtype=np.float32)


def good():
    return build_infer_request("mha", q())


def edited(edit):
    request = good()
    edit(request)
    return request


def with_inputs(*tensors):
    """A request from (name, datatype, shape, raw bytes) tuples."""
    request = pb.ModelInferRequest(model_name="mha")
    for name, datatype, shape, raw in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(raw)
    return request


def fp32(shape, value=0.5):
    return ("FP32", shape, np.full(shape, value, dtype=np.float32).tobytes())


def typed_query(field, values, datatype="FP32", shape=(1, 1, D)):
    request = pb.ModelInferRequest(model_name="mha")
    tensor = request.inputs.add(name="query", datatype=datatype, shape=shape)
    getattr(tensor.contents, field).extend(values)
    return request


def typed_mask(datatype, field, values):
    """A typed-contents request: query of 4 rows, and a [1, 4] mask with ``values``."""
    request = typed_query("fp32_contents", [0.5] * 4 * D, shape=(1, 4, D))
    getattr(request.inputs.add(name="mask", datatype=datatype, shape=(1, 4)).contents, field).extend(values)
    return request


def set_shape(request, index, shape):
    del request.inputs[index].shape[:]
    request.inputs[index].shape.extend(shape)


def nan_query():
    x = q()
    x[0, 1, 2] = np.nan
    return build_infer_request("mha", x)


def inf_key():
    k = q(n=3)
    k[0, 0, 0] = np.inf
    return build_infer_request("mha", q(), key=k, value=q(n=3))


MALFORMED = {
    "unknown model": (edited(lambda r: setattr(r, "model_name", "gpt")), NOT_FOUND, ["'gpt'", "'mha'"]),
    "unknown version": (edited(lambda r: setattr(r, "model_version", "3")), NOT_FOUND, ["version '3'", "'1'"]),
    "missing query": (with_inputs(("key", *fp32((1, 4, D)))), INVALID, ["'query' is missing"]),
    "query FP64": (
        with_inputs(("query", "FP64", (1, 4, D), q().astype(np.float64).tobytes())),
        INVALID,
        ["'query'", "'FP64'", "FP32"],
    ),
    "query rank 2": (with_inputs(("query", *fp32((4, D)))), INVALID, ["'query'", f"[4, {D}]", "rank 3"]),
    "query wrong d_model": (
        with_inputs(("query", *fp32((1, 4, D + 2)))),
        INVALID,
        ["'query'", f"last dim {D + 2}", f"d_model {D}"],
    ),
    "raw bytes too short": (
        edited(lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 12)),
        INVALID,
        ["'query'", "12 bytes", f"expected {4 * 4 * D}"],
    ),
    "raw contents count": (
        edited(lambda r: r.raw_input_contents.append(b"")),
        INVALID,
        ["raw_input_contents holds 2 entries for 1 inputs"],
    ),
    "batch mismatch": (
        build_infer_request("mha", q(b=2), key=q(b=3), value=q(b=3)),
        INVALID,
        ["'key'", "batch 3", "expected 2"],
    ),
    "value length": (
        build_infer_request("mha", q(), key=q(n=5), value=q(n=6)),
        INVALID,
        ["'value'", "length 6", "expected 5"],
    ),
    "value without key": (
        with_inputs(("query", *fp32((1, 4, D))), ("value", *fp32((1, 4, D)))),
        INVALID,
        ["'value' is given without 'key'"],
    ),
    "mask shape": (
        build_infer_request("mha", q(), mask=np.ones((1, 3), dtype=bool)),
        INVALID,
        ["'mask'", "[1, 3]", "[1, 4] (key padding)"],
    ),
    "mask rank 4": (
        build_infer_request("mha", q(), mask=np.ones((1, 1, 4, 4), dtype=bool)),
        INVALID,
        ["'mask'", "[1, 1, 4, 4]"],
    ),
    "mask FP32": (
        build_infer_request("mha", q(), mask=np.ones((1, 4), dtype=np.float32)),
        INVALID,
        ["'mask'", "'FP32'", "BOOL"],
    ),
    "unknown input": (
        with_inputs(("query", *fp32((1, 4, D))), ("bias", *fp32((1, 4, D)))),
        INVALID,
        ["unknown input 'bias'", "query, key, value, mask"],
    ),
    "duplicate input": (
        with_inputs(("query", *fp32((1, 4, D))), ("query", *fp32((1, 4, D)))),
        INVALID,
        ["'query' is given more than once"],
    ),
    "raw and typed mixed": (
        edited(lambda r: r.inputs[0].contents.fp32_contents.append(1.0)),
        INVALID,
        ["'query'", "typed contents", "raw_input_contents"],
    ),
    "typed count": (
        typed_query("fp32_contents", [0.5] * 3),
        INVALID,
        ["'query'", "3 values in contents.fp32_contents", f"expected {D}"],
    ),
    "typed wrong field": (
        typed_query("int64_contents", [1] * D),
        INVALID,
        ["'query'", "contents.fp32_contents", "got contents.int64_contents"],
    ),
    "typed INT8 mask out of range": (
        typed_mask("INT8", "int_contents", [1, 1, 300, 0]),
        INVALID,
        ["'mask'", "value 300", "out of range for INT8 [-128, 127]"],
    ),
    "unknown datatype": (with_inputs(("query", "FOO", (1, 4, D), b"")), INVALID, ["'query'", "'FOO'"]),
    "negative dim": (edited(lambda r: set_shape(r, 0, [1, -4, D])), INVALID, ["'query'", "negative"]),
    "zero length": (with_inputs(("query", *fp32((1, 0, D)))), INVALID, ["'query'", "at least 1"]),
    # Zero elements beside a huge dim: numpy called it "too big" (INTERNAL, and a traceback logged per request).
    "zero batch, huge length": (
        with_inputs(("query", "FP32", (0, 2**63 - 1, D), b"")),
        INVALID,
        ["'query'", "holds no elements", str(2**63 - 1)],
    ),
    "NaN in query": (nan_query(), INVALID, ["'query'", "1 non-finite"]),
    "Inf in key": (inf_key(), INVALID, ["'key'", "1 non-finite"]),
    "unknown output": (
        edited(lambda r: r.outputs.add(name="logits")),
        INVALID,
        ["requested output 'logits'", "output, attn_weights"],
    ),
    "duplicate output": (edited(lambda r: r.outputs.add(name="output")), INVALID, ["more than once"]),
    "batch over limit": (
        build_infer_request("mha", q(b=9, n=1)),
        EXHAUSTED,
        ["'query'", "batch 9", "max_batch_size=8"],
    ),
    "q_len over limit": (build_infer_request("mha", q(n=65)), EXHAUSTED, ["q_len 65", "max_q_len=64"]),
    "kv_len over limit": (build_infer_request("mha", q(), key=q(n=70)), EXHAUSTED, ["kv_len 70", "max_kv_len=64"]),
}


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def test_the_matrix_is_large():
    assert len(MALFORMED) >= 20


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_request_gets_a_precise_status(stub, name):
    request, code, fragments = MALFORMED[name]
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(request, timeout=10)
    assert error.value.code() == code, error.value.details()
    for fragment in fragments:
        assert fragment in error.value.details()


def test_after_every_malformed_request_a_good_one_is_served(stub, server):
    for request, _, _ in MALFORMED.values():
        with pytest.raises(grpc.RpcError):
            stub.ModelInfer(request, timeout=10)
    response = stub.ModelInfer(good(), timeout=10)
    assert [o.name for o in response.outputs] == ["output", "attn_weights"]
    assert server.proc.poll() is None


def test_a_message_over_the_size_limit_is_resource_exhausted(start_server, small_model_dir):

    server = start_server(small_model_dir, "--max-message-bytes", "100000", "--warmup-runs", "0")
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            stub.ModelInfer(build_infer_request("mha", q(n=200)), timeout=10)
        assert error.value.code() == EXHAUSTED
        assert stub.ModelInfer(build_infer_request("mha", q(n=2)), timeout=10).outputs


@pytest.mark.parametrize("scale", [1e38, 3e38])
def test_a_computation_that_overflows_is_refused_never_answered_with_nan(stub, small_module, scale):
    # Finite values (at 3e38 their float32 sum overflows, yet they are finite and pass the input check) whose
    # projections overflow float32 made NaN answers with status OK. Query and key of such a magnitude are refused
    # before the run (past the range where masks decide); values are not, and overflow in the run.
    row = small_module.W_v.weight.detach().numpy()[0]  # every value's sign that row's: past float32, projected
    x = np.broadcast_to(np.sign(row) * np.float32(scale), (1, 4, D)).astype(np.float32)
    query = np.random.default_rng(1).standard_normal((1, 2, D), dtype=np.float32)
    assert np.isfinite(x).all()
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(build_infer_request("mha", query, query.repeat(2, axis=1), x), timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the computation overflowed float32" in error.value.details()
    assert "output '" in error.value.details() and "input '" not in error.value.details()
    # large inputs that do not overflow are served
    response = stub.ModelInfer(build_infer_request("mha", x / scale * 1e6), timeout=10)
    assert [o.name for o in response.outputs] == ["output", "attn_weights"]


# Every kind of output a request can ask for, alone and together: each is cut from the run's weights.
DERIVED_FROM_THE_WEIGHTS = {
    "top-k indices": (["attn_weights_top_k_indices"], {"attn_top_k": 4}),
    "top-k values and indices": (["attn_weights_top_k_values", "attn_weights_top_k_indices"], {"attn_top_k": 4}),
    "top-p indices": (["attn_weights_top_k_indices"], {"attn_top_p": 0.9}),
    "top-p values and indices": (["attn_weights_top_k_values", "attn_weights_top_k_indices"], {"attn_top_p": 0.9}),
    "a head's rows": (["attn_weights"], {"attn_heads": "1", "attn_rows": "0:2"}),
    "a key window in fp16": (["attn_weights"], {"attn_keys": "1:3", "attn_weights_precision": "FP16"}),
    "the mean over heads": (["attn_weights_mean"], {}),
    "the output and top-k": (["output", "attn_weights_top_k_indices"], {"attn_top_k": 2}),
}


@pytest.mark.parametrize("scale", [1e20, 1e24, 1e30])
@pytest.mark.parametrize("asked", DERIVED_FROM_THE_WEIGHTS)
def test_nothing_cut_from_an_overflowed_run_comes_back_ok(stub, small_module, scale, asked):
    from tests.support import eager

    outputs, parameters = DERIVED_FROM_THE_WEIGHTS[asked]
    x = (np.random.default_rng(1).uniform(-1, 1, (1, 4, D)) * scale).astype(np.float32)
    assert np.isfinite(x).all() and np.isnan(eager(small_module, x)[1]).any()  # q·k overflows float32
    request = build_infer_request("mha", x)
    del request.outputs[:]
    request.outputs.extend(pb.ModelInferRequest.InferRequestedOutputTensor(name=name) for name in outputs)
    for name, value in parameters.items():
        field = "int64_param" if isinstance(value, int) else "double_param" if isinstance(value, float) else None
        setattr(request.parameters[name], field or "string_param", value)
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    # refused before the run (query and key past the range where masks decide) or after it (overflowed)
    refusals = ("the computation overflowed float32", "where a mask no longer decides")
    assert any(refusal in error.value.details() for refusal in refusals), error.value.details()


@pytest.mark.parametrize("true_byte", [0x02, 0x80, 0xFF])
def test_any_nonzero_bool_mask_byte_means_true(stub, true_byte):
    # Raw BOOL bytes other than 0/1 reached ONNX Runtime as they were: rows summing to 2, or NaN, with OK.
    x = np.random.default_rng(1).standard_normal((2, 3, D)).astype(np.float32)
    ones = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], dtype=np.uint8)  # Lk = 5, not a multiple of 4

    def answer(mask_bytes):
        request = build_infer_request("mha", x, x[:, :1].repeat(5, axis=1), x[:, :1].repeat(5, axis=1))
        request.inputs.add(name="mask", datatype="BOOL", shape=[2, 5])
        request.raw_input_contents.append(mask_bytes.tobytes())
        response = stub.ModelInfer(request, timeout=10)
        return [np.frombuffer(raw, dtype=np.float32) for raw in response.raw_output_contents]

    want = answer(ones)
    got = answer(ones * true_byte)
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w) and np.isfinite(g).all()


@pytest.mark.parametrize("outputs", [["output", "attn_weights"], ["attn_weights"], ["output"]])
def test_a_masked_key_never_takes_the_weight_at_a_crafted_scale(stub, small_module, outputs):
    # Built from the served weights: the allowed key's score overflows to -inf, the masked key's is 0. The mask's
    # bias is finite, so the masked key took every head's weight, every value finite, with OK. Such inputs lie past
    # the range the export records for masks to decide exactly, and are refused before the run.
    from tests.support.crafted import crafted_cross_attention

    query, key, mask = crafted_cross_attention(small_module)
    request = build_infer_request("mha", query, key, key, mask[:, 0, 0])  # key padding [1, 0]
    del request.outputs[:]
    request.outputs.extend(pb.ModelInferRequest.InferRequestedOutputTensor(name=name) for name in outputs)
    with pytest.raises(grpc.RpcError) as error:
        stub.ModelInfer(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert "where a mask no longer decides" in error.value.details() and "input 'query'" in error.value.details()
