"""The REST binding's wire format (KServe v2 with Triton's binary tensor data extension): a body into the neutral
``InferenceRequest``, an ``InferenceResponse`` into a body. No HTTP here: the routes read bodies and write
answers.

JSON tensors (``data`` flat or nested, row-major) and binary ones both ways: with an
``Inference-Header-Content-Length`` header, the body is that many bytes of JSON followed by each binary input's
bytes in input order (``parameters.binary_data_size``); binary inputs are read from the body without a copy,
and binary outputs are written from their arrays, never through Python lists.
"""

from __future__ import annotations

import numpy as np
import orjson

from mhaserve.contract.datatypes import datatype_of
from mhaserve.contract.errors import json_kind

from ..dataplane import InferenceCall
from ..errors import RequestError, invalid
from ..inference import InferenceRequest, InferenceResponse, RequestedOutput, SharedInput, decodes_slowly
from ..parameters import boolean, quoted
from ..shared_memory import placement_of
from ..tensors import CONVERT_CHUNK, array_from_bytes, array_from_values, check_input_header, wire_bytes

HEADER_LENGTH = "Inference-Header-Content-Length"


def _parameters(entry: dict, where: str) -> dict:
    parameters = entry.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise invalid(f"{where}: 'parameters' must be a JSON object")
    return parameters


def decode_rest_request(name: str, version: str, body: bytes, header_length: int | None) -> InferenceRequest:
    """The request in ``body`` (``header_length``: the JSON header's length when binary data follows it)."""
    if header_length is not None and header_length > len(body):
        raise invalid(f"{HEADER_LENGTH} {header_length} is longer than the body ({len(body)} bytes)")
    json_part = body if header_length is None else memoryview(body)[:header_length]
    try:
        document = orjson.loads(json_part)
    except orjson.JSONDecodeError as error:
        raise invalid(f"the request body is not valid JSON ({error})") from None
    if not isinstance(document, dict):
        raise invalid(f"the request body is a JSON {json_kind(document)}, expected an object with 'inputs'")
    inputs = document.get("inputs")
    if not isinstance(inputs, list):
        raise invalid("the request has no 'inputs' list")
    binary = memoryview(body)[header_length:] if header_length is not None else memoryview(b"")
    offset = 0
    arrays: dict[str, np.ndarray] = {}
    shared: dict[str, SharedInput] = {}
    for entry in inputs:
        if not isinstance(entry, dict):
            raise invalid("each of 'inputs' must be a JSON object with name, shape, datatype and data")
        input_name, datatype, shape = entry.get("name"), entry.get("datatype"), entry.get("shape")
        if not isinstance(input_name, str) or not isinstance(datatype, str):
            raise invalid(f"input {input_name!r}: 'name' and 'datatype' must be strings")
        check_input_header(input_name, datatype, arrays.keys() | shared.keys())
        if not isinstance(shape, list) or not all(type(d) is int for d in shape):
            if isinstance(shape, list) and any(isinstance(d, float) and abs(d) >= 2**63 for d in shape):
                # a JSON decoder reads an integer past 64 bits as a float: not shown rounded as if it were sent so
                raise invalid(f"input '{input_name}': 'shape' has a dimension of 2^63 or more")
            raise invalid(f"input '{input_name}': 'shape' is {_as_written(shape)}, expected a list of integers")
        parameters = _parameters(entry, f"input '{input_name}'")
        size = parameters.get("binary_data_size")
        placement = placement_of(parameters, f"input '{input_name}'")
        if placement is not None:
            if size is not None or "data" in entry:
                raise invalid(f"input '{input_name}': has data and a shared memory region; give one")
            shared[input_name] = SharedInput(datatype, tuple(shape), placement)
        elif size is not None:
            if "data" in entry:  # which one is meant cannot be known: neither is taken
                raise invalid(
                    f"input '{input_name}': has both 'data' and a binary_data_size parameter; give one (the "
                    "binary data after the JSON, or 'data' in it)"
                )
            if type(size) is not int or size < 0 or offset + size > len(binary):
                raise invalid(
                    f"input '{input_name}': binary_data_size {size!r}, but {len(binary) - offset} bytes of binary "
                    f"data remain after the JSON header ({HEADER_LENGTH})"
                )
            arrays[input_name] = array_from_bytes(
                input_name, datatype, shape, binary[offset : offset + size], "binary data"
            )
            offset += size
        else:
            arrays[input_name] = _array_from_json(input_name, datatype, shape, entry.get("data"))
    if offset != len(binary):
        raise invalid(f"{len(binary) - offset} bytes of binary data follow the inputs' binary_data_size; expected 0")

    parameters = _parameters(document, "the request")
    outputs = document.get("outputs") or []
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise invalid("'outputs' must be a list of objects with a 'name'")
    requested = tuple(RequestedOutput(o["name"], _parameters(o, f"output '{o['name']}'")) for o in outputs)
    if "binary_data_output" in parameters:
        boolean(parameters["binary_data_output"], "binary_data_output")
    for output in requested:
        if "binary_data" in output.parameters:
            boolean(output.parameters["binary_data"], "binary_data")
    request_id = document.get("id", "")
    if not isinstance(request_id, str):
        raise invalid(f"the request's 'id' must be a string, got {quoted(request_id)}")
    return InferenceRequest(name, version, request_id, arrays, requested, parameters, shared)


def _as_written(value) -> str:
    """A JSON value for a message, as a client would have written it (a list as JSON writes it)."""
    if isinstance(value, list):
        return "[" + ", ".join(_as_written(v) for v in value) + "]"
    return orjson.dumps(value).decode()


def _array_from_json(name: str, datatype: str, shape: list[int], data) -> np.ndarray:
    if not isinstance(data, list):
        raise invalid(f"input '{name}': no 'data' list and no binary_data_size parameter")
    try:
        pieces = [np.asarray(piece) for piece in _json_pieces(name, shape, data)]
    except ValueError:  # a piece holding lists of different lengths
        raise _misnested(name, shape) from None
    if any(piece.ndim != 1 for piece in pieces):
        raise _misnested(name, shape)
    values = np.concatenate(pieces) if pieces else np.zeros(0)
    if values.dtype.kind not in "biuf":
        held = "strings" if values.dtype.kind == "U" else "values that are not all numbers (null, objects, mixed)"
        raise invalid(f"input '{name}': 'data' holds {held}, not {datatype} numbers")
    if datatype == "BOOL" and values.dtype.kind != "b":
        raise invalid(f"input '{name}': BOOL data must be true or false")
    if datatype != "BOOL" and values.dtype.kind == "b":
        raise invalid(f"input '{name}': {datatype} data must be numbers, not true or false")
    if datatype != "BOOL" and datatype != "FP32" and values.dtype.kind == "f":
        raise invalid(f"input '{name}': {datatype} data must be integers")
    return array_from_values(name, datatype, shape, values, "data")


def _json_pieces(name: str, shape: list[int], data: list) -> list[list]:
    """The values of ``data`` (flat, or nested exactly as ``shape``) as flat lists of moderate length,
    each converted by its own call: a large tensor never holds the interpreter in one long conversion."""
    if not data or not isinstance(data[0], list):  # flat
        return [data[start : start + CONVERT_CHUNK] for start in range(0, len(data), CONVERT_CHUNK)]
    if not shape:
        raise _misnested(name, shape)
    level = [data]
    for dim in shape[:-1]:
        nested = []
        for item in level:
            if not isinstance(item, list) or len(item) != dim:
                raise _misnested(name, shape)
            nested.extend(item)
        level = nested
    if any(not isinstance(row, list) or len(row) != shape[-1] for row in level):
        raise _misnested(name, shape)
    return level


def _misnested(name: str, shape: list[int]) -> RequestError:
    return invalid(
        f"input '{name}': 'data' is a ragged nested list, or nested unlike the shape {shape}; send it "
        "flat or nested as the shape, row-major"
    )


def encode_rest_response(response: InferenceResponse) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary outputs follow it. An output is binary
    where its ``binary_data`` parameter says so, else where the request's ``binary_data_output`` does."""
    request = response.request
    binary_by_default = bool(request.parameters.get("binary_data_output", False))
    described, chunks = [], []
    for name, output in response.outputs.items():
        array = np.ascontiguousarray(output)
        entry = {"name": name, "datatype": datatype_of(array), "shape": list(array.shape)}
        if name in response.placed:  # in the client's shared memory: described, not sent
            pass
        elif request.output(name).parameters.get("binary_data", binary_by_default):
            entry["parameters"] = {"binary_data_size": array.nbytes}
            chunks.append(wire_bytes(array))
        else:
            entry["data"] = array.ravel()  # orjson writes the array itself, no Python floats
        described.append(entry)
    model = response.model
    header = orjson.dumps(
        {"model_name": model.name, "model_version": model.version, "id": response.id, "outputs": described},
        option=orjson.OPT_SERIALIZE_NUMPY,
    )
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def header_length_of(value: str | None) -> int | None:
    """The Inference-Header-Content-Length header: the JSON header's length, or None (the body is all JSON)."""
    if value is not None and not (value.isascii() and value.isdigit()):  # "²" is a digit to str, not to int
        raise invalid(f"{HEADER_LENGTH}: {value!r}, expected the JSON header's length in bytes")
    return int(value) if value is not None else None


async def infer_rest(
    call: InferenceCall, name: str, version: str, body: bytes, header_length: int | None
) -> tuple[bytes, int | None]:
    """One infer call's body through the data plane, whichever HTTP stack received it: the answer's body, and
    the JSON header's length when binary outputs follow it."""
    json_length = len(body) if header_length is None else min(header_length, len(body))
    slow = decodes_slowly(len(body), json_length)  # JSON values convert one by one; binary ones in whole arrays
    if slow:
        request = await call.off_loop(decode_rest_request, name, version, body, header_length)
    else:
        request = decode_rest_request(name, version, body, header_length)
    response = await call.infer(request)
    with call.encoding():
        return encode_rest_response(response)
