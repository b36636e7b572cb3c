"""The protobuf wire encoding: ModelInferRequest -> InferenceRequest and InferenceResponse -> ModelInferResponse bytes.

It finds each tensor in the message (raw_input_contents or the typed contents field) and leaves every
rule about names, datatypes, shapes and limits to ``tensors.py``, which the REST transport shares.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mhaserve.contract.datatypes import datatype_of
from mhaserve.contract.signature import ModelSignature
from mhaserve.protos.generated import grpc_service_pb2 as pb

from ..errors import invalid
from ..inference import (
    NO_PARAMETERS,
    InferenceRequest,
    InferenceResponse,
    RequestedOutput,
    SharedInput,
    decodes_slowly,
    run_inputs_of,
)
from ..shared_memory import placement_of
from ..tensors import Limits, RunInputs, array_from_bytes, array_from_values, check_input_header, wire_bytes

# The typed `contents` field that carries each datatype.
CONTENTS_FIELDS = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "INT8": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


def _check_typed_contents_field(tensor) -> None:
    """Typed contents must be in the field that matches the datatype, and only there."""
    expected_field = CONTENTS_FIELDS[tensor.datatype]
    for field, _ in tensor.contents.ListFields():
        if field.name != expected_field:
            raise invalid(
                f"input '{tensor.name}': datatype {tensor.datatype} carries its values in "
                f"contents.{expected_field}, got contents.{field.name}"
            )


def decode_grpc_request(request: pb.ModelInferRequest) -> InferenceRequest:
    """The tensors, requested outputs and parameters of ``request`` (RequestError on the first problem). Inputs
    in shared memory carry no contents; ``raw_input_contents`` holds one entry per other input, in order."""
    raw_contents = request.raw_input_contents
    placements = [placement_of(parameter_values(t.parameters), f"input '{t.name}'") for t in request.inputs]
    sent = placements.count(None)
    if raw_contents and len(raw_contents) != sent:
        raise invalid(
            f"raw_input_contents holds {len(raw_contents)} entries for {sent} inputs not in shared memory; "
            "expected one per such input, in the order of inputs"
        )
    arrays: dict[str, np.ndarray] = {}
    shared: dict[str, SharedInput] = {}
    raw_index = 0
    for tensor, placement in zip(request.inputs, placements, strict=True):
        check_input_header(tensor.name, tensor.datatype, arrays.keys() | shared.keys())
        if placement is not None:
            if tensor.HasField("contents"):
                raise invalid(f"input '{tensor.name}': has contents and a shared memory region; give one")
            shared[tensor.name] = SharedInput(tensor.datatype, tuple(tensor.shape), placement)
        elif raw_contents and tensor.HasField("contents"):
            raise invalid(
                f"input '{tensor.name}': has typed contents while the request uses raw_input_contents; "
                "use one or the other for all inputs"
            )
        elif raw_contents:
            arrays[tensor.name] = array_from_bytes(tensor.name, tensor.datatype, tensor.shape, raw_contents[raw_index])
            raw_index += 1
        else:
            _check_typed_contents_field(tensor)
            field = CONTENTS_FIELDS[tensor.datatype]
            values = getattr(tensor.contents, field)
            arrays[tensor.name] = array_from_values(
                tensor.name, tensor.datatype, tensor.shape, values, f"contents.{field}"
            )
    return InferenceRequest(
        request.model_name,
        request.model_version,
        request.id,
        arrays,
        tuple(RequestedOutput(o.name, parameter_values(o.parameters)) for o in request.outputs),
        parameter_values(request.parameters),
        shared,
    )


def parameter_values(parameters) -> Mapping[str, object]:
    """A protobuf ``map<string, InferParameter>`` as plain values."""
    if not parameters:
        return NO_PARAMETERS
    return {
        name: getattr(value, value.WhichOneof("parameter_choice") or "string_param")
        for name, value in parameters.items()
    }


def as_infer_parameters(values: Mapping[str, object]) -> dict[str, dict]:
    """Plain values as a ``map<string, InferParameter>`` in protobuf's JSON form (the inverse of parameter_values)."""

    def choice(value) -> str:
        if isinstance(value, bool):
            return "bool_param"
        if isinstance(value, int):
            return "int64_param"
        return "double_param" if isinstance(value, float) else "string_param"

    return {name: {choice(value): value} for name, value in values.items()}


def decode_infer_request(request: pb.ModelInferRequest, model: ModelSignature, limits: Limits) -> RunInputs:
    """``request`` decoded and checked against the model it names and the limits (RequestError otherwise)."""
    return run_inputs_of(decode_grpc_request(request), model, limits)


def encode_grpc_response(response: InferenceResponse, *, streamed: bool = False) -> bytes:
    """The serialised ModelInferResponse: outputs as raw little-endian bytes, in the order requested;
    ``streamed``: the ModelStreamInferResponse carrying it.

    Protobuf messages may be written field by field and concatenated, so each output goes from its
    array onto the wire bytes in one copy (``b"".join``), not copied into a message and out again by
    serialisation (BENCHMARKS.md, "Figures behind the server's defaults").
    """
    model = response.model
    header = pb.ModelInferResponse(model_name=model.name, model_version=model.version, id=response.id)
    raw_outputs = []
    for name, output in response.outputs.items():
        header.outputs.add(name=name, datatype=datatype_of(output), shape=output.shape)
        if name in response.placed:  # in the client's shared memory: an empty entry keeps the outputs' order
            raw_outputs.append(_length_delimited(_RAW_OUTPUT_CONTENTS, 0))
            continue
        array = np.ascontiguousarray(output)
        raw_outputs += [_length_delimited(_RAW_OUTPUT_CONTENTS, array.nbytes), wire_bytes(array)]
    parts = [header.SerializeToString(), *raw_outputs]
    if streamed:  # the infer_response field's tag and length, then the same bytes
        parts.insert(0, _length_delimited(_STREAM_INFER_RESPONSE, sum(len(part) for part in parts)))
    return b"".join(parts)


def grpc_decodes_slowly(request: pb.ModelInferRequest) -> bool:
    """inference.decodes_slowly for a protobuf request: its raw contents' bytes, its typed values (counted at
    four bytes each)."""
    raw = sum(len(contents) for contents in request.raw_input_contents)
    typed = 0 if request.raw_input_contents else sum(_typed_values(tensor) for tensor in request.inputs)
    return decodes_slowly(raw + 4 * typed, 4 * typed)


def _typed_values(tensor) -> int:
    field = CONTENTS_FIELDS.get(tensor.datatype)
    return len(getattr(tensor.contents, field)) if field else 0


_RAW_OUTPUT_CONTENTS = pb.ModelInferResponse.DESCRIPTOR.fields_by_name["raw_output_contents"].number
_STREAM_INFER_RESPONSE = pb.ModelStreamInferResponse.DESCRIPTOR.fields_by_name["infer_response"].number


def _length_delimited(field_number: int, size: int) -> bytes:
    """The tag and length that open a bytes or message field of ``size`` bytes on the wire."""
    return _varint(field_number << 3 | 2) + _varint(size)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
