"""The codec's wire encoding: answers written field by field parse as the protocol's messages."""

from __future__ import annotations

import numpy as np

from mhaserve.contract.signature import ModelSignature
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.server.grpc.protobuf import encode_grpc_response
from mhaserve.server.inference import InferenceRequest, InferenceResponse
from tests.support import rand

MODEL = ModelSignature("mha", "1", 64, 4)


def response(outputs: dict[str, np.ndarray], order: tuple[str, ...]) -> InferenceResponse:
    """The data plane's answer to request "req-7": ``outputs`` in ``order``."""
    return InferenceResponse(MODEL, InferenceRequest("mha", "1", "req-7"), {name: outputs[name] for name in order})


def test_encoded_answer_parses_to_the_arrays_in_the_requested_order():
    merged_weights = rand(6, 4, 300, 300)  # a request's rows cut from a padded merged run: not contiguous
    # 150 KiB and 800 bytes: lengths of three bytes and of two on the wire
    outputs = {"output": rand(2, 300, 64), "attn_weights": merged_weights[2:4, :, :5, :5]}
    for order in (("attn_weights", "output"), ("output",)):
        message = pb.ModelInferResponse.FromString(encode_grpc_response(response(outputs, order)))
        assert (message.model_name, message.model_version, message.id) == ("mha", "1", "req-7")
        assert [t.name for t in message.outputs] == list(order)
        assert len(message.raw_output_contents) == len(order)
        for tensor, raw in zip(message.outputs, message.raw_output_contents, strict=True):
            assert tensor.datatype == "FP32" and tuple(tensor.shape) == outputs[tensor.name].shape
            parsed = np.frombuffer(raw, np.float32).reshape(tuple(tensor.shape))
            np.testing.assert_array_equal(parsed, outputs[tensor.name])


def test_stream_answer_wraps_the_encoded_answer():
    outputs = {"output": rand(2, 5, 64, seed=1), "attn_weights": rand(2, 4, 5, 5, seed=2)}
    answer = response(outputs, ("output", "attn_weights"))
    encoded = encode_grpc_response(answer)
    stream = pb.ModelStreamInferResponse.FromString(encode_grpc_response(answer, streamed=True))
    assert stream.error_message == ""
    assert stream.infer_response == pb.ModelInferResponse.FromString(encoded)
