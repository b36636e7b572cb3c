"""Property-based fuzzing of the request decoder, in process and over the wire.

Thousands of generated and mutated ModelInferRequests (shapes, datatypes, byte lengths, typed contents,
parameters, names, empty and huge fields): each one decodes, or is refused with a precise status. No
other exception, and a running server answers a good request afterwards.

The examples are derandomized so CI is repeatable; MHASERVE_FUZZ_EXAMPLES=100000 MHASERVE_FUZZ_RANDOM=1
runs a long, freshly random search.
"""

from __future__ import annotations

import os

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mhaserve.client.grpc import build_infer_request
from mhaserve.contract.datatypes import DATATYPES
from mhaserve.contract.signature import ModelSignature
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.server.errors import ErrorKind, RequestError
from mhaserve.server.grpc.protobuf import CONTENTS_FIELDS, decode_infer_request
from mhaserve.server.tensors import INPUT_NAMES, OUTPUT_NAMES, Limits, RunInputs
from tests.support import SMALL_D_MODEL, SMALL_HEADS, rand

D = SMALL_D_MODEL
MODEL = ModelSignature("mha", "1", D, SMALL_HEADS)
LIMITS = Limits(max_batch_size=8, max_q_len=64, max_kv_len=64)  # the test server's limits
REFUSALS = {ErrorKind.INVALID_ARGUMENT, ErrorKind.RESOURCE_EXHAUSTED, ErrorKind.NOT_FOUND}
EXAMPLES = int(os.environ.get("MHASERVE_FUZZ_EXAMPLES", "1500"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not os.environ.get("MHASERVE_FUZZ_RANDOM"),
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Dimensions near the edges: empty, one, the model's width, the limits, and absurd.
dims = st.one_of(
    st.sampled_from([0, 1, 2, 3, D, D - 1, D + 1, 63, 64, 65, 2**31, 2**40, 2**62, -1]),
    st.integers(min_value=-(2**63), max_value=2**63 - 1),
)
names = st.one_of(st.sampled_from([*INPUT_NAMES, "", "Query", "query\x00", "x" * 1000]), st.text(max_size=20))
datatypes = st.one_of(st.sampled_from([*DATATYPES, "FP16", "BYTES", "BF16", "UINT64", "", "fp32"]), st.text(max_size=8))
CONTENT_FIELDS = {
    "bool_contents": st.booleans(),
    "int_contents": st.integers(-(2**31), 2**31 - 1),
    "int64_contents": st.integers(-(2**63), 2**63 - 1),
    "uint_contents": st.integers(0, 2**32 - 1),
    "uint64_contents": st.integers(0, 2**64 - 1),
    "fp32_contents": st.floats(width=32),
    "fp64_contents": st.floats(),
    "bytes_contents": st.binary(max_size=8),
}


@st.composite
def tensors(draw):
    """One input tensor: a name, a datatype, a shape, and either raw bytes or typed contents (or both)."""
    name = draw(names)
    datatype = draw(datatypes)
    shape = draw(st.one_of(st.lists(dims, max_size=5), st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    # Raw bytes of the right length for the declared shape (when it is small), or any length.
    dtype = DATATYPES[datatype] if datatype in DATATYPES else np.dtype(np.uint8)
    count = int(np.prod([max(d, 0) for d in shape])) if shape and all(0 <= d < 10_000 for d in shape) else 0
    exact = count * dtype.itemsize if count * dtype.itemsize <= 1 << 16 else 0
    raw = draw(st.one_of(st.binary(min_size=exact, max_size=exact), st.binary(max_size=64), st.none()))
    contents = None
    if draw(st.booleans()):
        field = draw(st.sampled_from(sorted(CONTENT_FIELDS)))
        contents = (field, draw(st.lists(CONTENT_FIELDS[field], max_size=min(max(count, 4), 64))))
    return name, datatype, shape, raw, contents


# Each datatype's typed field, with values over the whole range the field can carry (not the datatype).
FIELD_OF = CONTENTS_FIELDS


@st.composite
def typed_tensors(draw):
    """A well-formed typed tensor: right field for its datatype, as many values as its shape holds."""
    name = draw(st.sampled_from(INPUT_NAMES))
    datatype = draw(st.sampled_from(sorted(FIELD_OF)))  # FP16 has no typed field: raw bytes only
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    if name != "mask" and draw(st.booleans()):
        shape = [draw(st.integers(1, 2)), draw(st.integers(1, 2)), D]
    field = FIELD_OF[datatype]
    values = draw(st.lists(CONTENT_FIELDS[field], min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    return name, datatype, shape, None, (field, values)


@st.composite
def requests(draw):
    request = pb.ModelInferRequest(
        model_name=draw(st.sampled_from(["mha", "mha", "mha", "", "other"])),
        model_version=draw(st.sampled_from(["", "", "1", "2", "latest"])),
        id=draw(st.text(max_size=10)),
    )
    use_raw = draw(st.booleans())
    for name, datatype, shape, raw, contents in draw(st.lists(st.one_of(tensors(), typed_tensors()), max_size=5)):
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        if contents is not None:
            getattr(tensor.contents, contents[0]).extend(contents[1])
        if use_raw and raw is not None:
            request.raw_input_contents.append(raw)
        if draw(st.booleans()):
            tensor.parameters["binary_data_size"].int64_param = draw(st.integers(-5, 2**40))
    for output in draw(st.lists(st.one_of(st.sampled_from(OUTPUT_NAMES), names), max_size=3)):
        request.outputs.add(name=output)
    if draw(st.booleans()):
        request.parameters[draw(st.text(max_size=8))].string_param = draw(st.text(max_size=8))
    return request


def valid_request(draw) -> pb.ModelInferRequest:
    """A request the server accepts: self- or cross-attention, maybe a mask, maybe one output."""
    b, lq, lk = draw(st.integers(1, 3)), draw(st.integers(1, 8)), draw(st.integers(1, 8))
    seed = draw(st.integers(0, 2**16))
    cross = draw(st.booleans())
    key = rand(b, lk, D, seed=seed + 1) if cross else None
    mask = None
    if draw(st.booleans()):
        mask = np.random.default_rng(seed).random((b, lk if cross else lq)) < 0.7
    return build_infer_request("mha", rand(b, lq, D, seed=seed), key, key, mask, attn_weights=draw(st.booleans()))


@st.composite
def mutated(draw):
    """A valid request, serialized, with a few bytes overwritten, inserted or cut: parsed if it still parses."""
    data = bytearray(valid_request(draw).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["set", "insert", "cut"]))
        if action == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif action == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=4))
        else:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


def check_decodes_or_refuses(request: pb.ModelInferRequest) -> None:
    try:
        decoded = decode_infer_request(request, MODEL, LIMITS)
    except RequestError as error:
        assert error.kind in REFUSALS, (error.kind, error.message)
        assert error.message
        return
    assert isinstance(decoded, RunInputs)
    b, lq, d = decoded.query.shape
    assert d == D and 1 <= b <= LIMITS.max_batch_size and 1 <= lq <= LIMITS.max_q_len
    assert decoded.key.shape[0] == b and decoded.value.shape == decoded.key.shape
    assert decoded.mask.dtype == np.bool_ and decoded.mask.ndim == 4
    assert set(decoded.outputs) <= set(OUTPUT_NAMES)


@FUZZ
@given(requests())
def test_generated_requests_decode_or_get_a_precise_refusal(request):
    check_decodes_or_refuses(request)


@FUZZ
@given(mutated())
def test_mutated_requests_decode_or_get_a_precise_refusal(data):
    try:
        request = pb.ModelInferRequest.FromString(data)
    except Exception:  # noqa: BLE001 - not a message at all: the transport refuses it (see below)
        return
    check_decodes_or_refuses(request)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(st.data())
def test_valid_requests_always_decode(data):
    decoded = decode_infer_request(valid_request(data.draw), MODEL, LIMITS)
    assert decoded.query.shape[2] == D


WIRE_EXAMPLES = int(os.environ.get("MHASERVE_FUZZ_WIRE_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def raw_infer(server):
    """ModelInfer taking and returning bytes, so undecodable messages reach the server too."""
    with grpc.insecure_channel(server.url) as channel:
        yield channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")


def test_fuzzed_requests_over_the_wire_get_only_expected_statuses(server, raw_infer):
    seen: dict[str, int] = {}

    @settings(max_examples=WIRE_EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])  # fmt: skip
    @given(st.one_of(requests().map(lambda r: r.SerializeToString()), mutated()))
    def call(data):
        try:
            raw_infer(data, timeout=10)
            code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            code = error.code()
        seen[code.name] = seen.get(code.name, 0) + 1
        # Bytes that are no ModelInferRequest at all included: INVALID_ARGUMENT, not gRPC's UNKNOWN.
        assert code.name in {kind.name for kind in REFUSALS} | {"OK"}, code

    call()
    assert seen.get("INVALID_ARGUMENT", 0) > 0 and sum(seen.values()) >= min(WIRE_EXAMPLES, 100), seen
    good = build_infer_request("mha", rand(2, 5, D, seed=9))
    answer = pb.ModelInferResponse.FromString(raw_infer(good.SerializeToString(), timeout=10))
    assert [o.name for o in answer.outputs] == ["output", "attn_weights"]
    assert server.proc.poll() is None


def test_bytes_that_are_no_request_message_are_invalid_argument(server, raw_infer):
    with pytest.raises(grpc.RpcError) as refused:
        raw_infer(b"\x00\x03mha*", timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "is not a valid inference.ModelInferRequest" in refused.value.details()
    with grpc.insecure_channel(server.url) as channel:
        # On a stream, that message answers with error_message and the stream goes on (it used to end).
        stream = channel.stream_stream("/inference.GRPCInferenceService/ModelStreamInfer")
        good = build_infer_request("mha", np.zeros((1, 2, D), np.float32)).SerializeToString()
        answers = [
            pb.ModelStreamInferResponse.FromString(raw) for raw in stream(iter([b"\xff\xff\xff", good]), timeout=10)
        ]
        assert len(answers) == 2
        assert answers[0].error_message.startswith("INVALID_ARGUMENT: ") and "not a valid" in answers[0].error_message
        assert not answers[1].error_message and answers[1].infer_response.outputs
        assert pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10).live
