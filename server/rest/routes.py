"""HTTP/REST transport: the Open Inference Protocol's REST binding (KServe v2) with Triton's extensions,
on the same asyncio loop and data plane as gRPC.

JSON tensors (``data`` flat or nested, row-major) and Triton's binary tensor data extension both ways:
with an ``Inference-Header-Content-Length`` header, the body is that many bytes of JSON followed by each
binary input's bytes in input order (``parameters.binary_data_size``); binary inputs are read from the
body without a copy, and binary outputs are written from their arrays, never through Python lists.
Every rule about the tensors is ``tensors.py``'s, every decision the data plane's; refusals are its
RequestError kinds as HTTP statuses, with the gRPC status's message text in ``{"error": ...}``.
"""

from __future__ import annotations

import asyncio
import logging
import zlib

import numpy as np
import orjson
import swagger_ui_bundle
from aiohttp import web

from mhaserve.contract.datatypes import datatype_of

from .. import describe
from ..accounting import Receipt
from ..dataplane import DataPlane, InferenceCall
from ..errors import HTTP_STATUS, ErrorKind, RequestError, invalid
from ..inference import InferenceRequest, InferenceResponse, RequestedOutput, SharedInput, decodes_slowly
from ..parameters import boolean, quoted
from ..security import bearer_token_matches
from ..shared_memory import placement_of
from ..tensors import (
    CONVERT_CHUNK,
    array_from_bytes,
    array_from_values,
    check_input_header,
    wire_bytes,
)
from . import openapi

log = logging.getLogger("mhaserve.server")

RETRY_AFTER_S = "1"  # 429 and 503: the queue, the memory budget or a drain; worth retrying shortly
HEADER_LENGTH = "Inference-Header-Content-Length"
OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")  # probes need no token, as grpc.health.v1
API_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>mhaserve REST API</title>
<link rel="stylesheet" href="/v2/docs/static/swagger-ui.css"></head>
<body><div id="swagger-ui"></div><script src="/v2/docs/static/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/v2/docs/openapi.json", dom_id: "#swagger-ui"});</script></body></html>
"""


class BodyTooLarge(RequestError):
    """A body over the limit: RESOURCE_EXHAUSTED in the metrics as over gRPC, but 413 (not 429: a retry fails too)."""

    http_status = 413

    def __init__(self, limit: int, encoding: str | None = None):
        over = "is over" if encoding is None else f"inflates ({encoding}) past"
        super().__init__(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"the request body {over} the limit of {limit} bytes (the largest valid request; large tensors travel "
            "as binary data)",
        )


class UnsupportedEncoding(RequestError):
    """A Content-Encoding the server cannot inflate: 415, as RFC 9110 says."""

    http_status = 415

    def __init__(self, encoding: str):
        super().__init__(
            ErrorKind.INVALID_ARGUMENT,
            f"Content-Encoding {encoding!r} is not accepted; send the body as is, or gzip or deflate it",
        )


# Compressed bodies are inflated in steps of at most this many bytes, each off the event loop and counted
# against the body limit and the memory budget before the next; at most INFLATING_AT_ONCE bodies at a time.
INFLATE_STEP = 4 << 20
INFLATE_INPUT_SLICE = 1 << 20
INFLATING_AT_ONCE = 2
CONTENT_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # zlib's wbits for each


def error_response(status: int, message: str) -> web.Response:
    headers = {"Retry-After": RETRY_AFTER_S} if status in (429, 503) else None
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return web.Response(
        status=status, body=orjson.dumps({"error": message}), content_type="application/json", headers=headers
    )


def json_response(value, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), content_type="application/json")


# -- the wire format ------------------------------------------------------------------------------------


def _peer(request: web.Request) -> str:
    """The caller's address as aiohttp saw it ("" where it cannot tell)."""
    return request.remote or ""


def _word(value) -> bool:
    """A trace setting's value: a string, or an integer written as one."""
    return isinstance(value, str | int) and not isinstance(value, bool)


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
        raise invalid(f"the request body is a JSON {type(document).__name__}, expected an object with 'inputs'")
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
            raise invalid(f"input '{input_name}': 'shape' is {_as_written(shape)}, expected a list of integers")
        parameters = _parameters(entry, f"input '{input_name}'")
        size = parameters.get("binary_data_size")
        placement = placement_of(parameters, f"input '{input_name}'")
        if placement is not None:
            if size is not None or "data" in entry:
                raise invalid(f"input '{input_name}': has data and a shared memory region; give one")
            shared[input_name] = SharedInput(datatype, tuple(shape), placement)
        elif size is not None:
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
    """A JSON value for a message, as a client would have written it: orjson reads an integer past 64 bits
    as a float, which is shown as the integer it holds (2^64 as 18446744073709551616, not 1.8e+19)."""
    if isinstance(value, list):
        return "[" + ", ".join(_as_written(v) for v in value) + "]"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


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
        raise invalid(f"input '{name}': 'data' holds {values.dtype.kind!r}-kind values, not {datatype} numbers")
    if datatype == "BOOL" and values.dtype.kind != "b":
        raise invalid(f"input '{name}': BOOL data must be true or false")
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
    if value is not None and not value.isdigit():
        raise invalid(f"{HEADER_LENGTH}: {value!r}, expected the JSON header's length in bytes")
    return int(value) if value is not None else None


async def infer_rest(
    call: InferenceCall, name: str, version: str, body: bytes, header_length: int | None
) -> tuple[bytes, int | None]:
    """One infer call's body through the data plane, whichever HTTP stack received it: the answer's body, and
    the JSON header's length when binary outputs follow it."""
    json_length = len(body) if header_length is None else min(header_length, len(body))
    slow = decodes_slowly(len(body), json_length)  # JSON values convert one by one; binary ones in whole arrays
    response = await call.infer(name, version, decode_rest_request, name, version, body, header_length, slow=slow)
    return call.encode(encode_rest_response, response)


# -- the routes ------------------------------------------------------------------------------------------


class RestTransport:
    def __init__(
        self, dataplane: DataPlane, token: bytes | None, body_limit: int, read_timeout_s: float, write_timeout_s: float
    ):
        self.dataplane = dataplane
        self.token = token
        self.body_limit = body_limit
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self._inflating = asyncio.Semaphore(INFLATING_AT_ONCE)

    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.body_limit, middlewares=[self._errors, self._authenticate])
        model = "/v2/models/{name}"
        version = model + "/versions/{version}"
        app.add_routes(
            [
                web.get("/v2/health/live", self.live),
                web.get("/v2/health/ready", self.ready),
                web.get("/v2", self.server_metadata),
                web.get("/v2/models/stats", self.statistics),
                web.post("/v2/repository/index", self.repository_index),
                web.post("/v2/repository/models/{name}/load", self.load),
                web.post("/v2/repository/models/{name}/unload", self.unload),
                web.get("/v2/trace/setting", self.trace_setting),
                web.post("/v2/trace/setting", self.trace_setting),
            ]
        )
        for prefix in (model, version):
            app.add_routes(
                [
                    web.get(prefix, self.model_metadata),
                    web.get(prefix + "/ready", self.model_ready),
                    web.get(prefix + "/config", self.model_config),
                    web.get(prefix + "/stats", self.statistics),
                    web.post(prefix + "/infer", self.infer),
                ]
            )
        for kind in ("system", "cuda"):  # Triton's shared-memory extensions
            prefix, region = f"/v2/{kind}sharedmemory", f"/v2/{kind}sharedmemory/region/{{region}}"
            app.add_routes(
                [
                    web.get(prefix + "/status", self.shared_memory_status),
                    web.get(region + "/status", self.shared_memory_status),
                    web.post(region + "/register", self.shared_memory_register),
                    web.post(prefix + "/unregister", self.shared_memory_unregister),
                    web.post(region + "/unregister", self.shared_memory_unregister),
                ]
            )
        app.add_routes(
            [
                web.get(model + "/trace/setting", self.trace_setting),
                web.post(model + "/trace/setting", self.trace_setting),
                # The API's OpenAPI document and Swagger UI over it, from the installed package's files.
                web.get("/v2/docs", self.api_page),
                web.get("/v2/docs/openapi.json", self.api_document),
                web.static("/v2/docs/static", swagger_ui_bundle.swagger_ui_path),
            ]
        )
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every refusal as JSON: the data plane's kinds, and aiohttp's own (404 route, 405, 413 body)."""
        try:
            return await handler(request)
        except RequestError as error:
            return error_response(getattr(error, "http_status", HTTP_STATUS[error.kind]), error.message)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return error_response(error.status, f"{error.reason}: {request.method} {request.path}")

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        """Before the body is read: a refused request costs its headers, not its body."""
        if self.token is None or request.path in OPEN_PATHS:
            return await handler(request)
        presented = request.headers.getall("Authorization", [])
        if len(presented) == 1 and bearer_token_matches(presented[0], self.token):
            return await handler(request)
        self.dataplane.record_unauthenticated(request.path)
        return error_response(401, "missing or wrong bearer token: send the header 'Authorization: Bearer <token>'")

    async def _body(self, request: web.Request, receipt: Receipt | None = None) -> bytes | bytearray:
        """The whole body, inflated if it came compressed, within body_limit bytes both ways, its bytes counted
        in the request's ``receipt`` as they arrive (refused at once when it is full). The body
        must arrive within read_timeout_s: a client that sends half a body is not waited for forever."""
        encoding = request.headers.get("Content-Encoding", "identity").strip().lower() or "identity"
        if encoding != "identity" and encoding not in CONTENT_ENCODINGS:
            raise UnsupportedEncoding(encoding)
        try:
            async with asyncio.timeout(self.read_timeout_s):
                body = await self._receive(request, receipt)
        except TimeoutError:
            raise RequestError(
                ErrorKind.DEADLINE_EXCEEDED, f"the request body did not arrive within {self.read_timeout_s:g} s"
            ) from None
        return body if encoding == "identity" else await self._inflate(body, encoding, receipt)

    async def _receive(self, request: web.Request, receipt: Receipt | None) -> bytearray:
        declared = request.content_length
        if declared is not None and declared > self.body_limit:
            raise BodyTooLarge(self.body_limit)  # before a byte of it is read
        if declared is not None:
            if receipt is not None:
                receipt.add(declared)
            body = bytearray(declared)  # one buffer, filled in place
            filled = 0
            async for chunk in request.content.iter_any():
                body[filled : filled + len(chunk)] = chunk
                filled += len(chunk)
            if filled != declared:
                raise invalid(f"the request body ended after {filled} of its {declared} bytes (Content-Length)")
            return body
        body = bytearray()  # chunked: counted chunk by chunk
        async for chunk in request.content.iter_any():
            if len(body) + len(chunk) > self.body_limit:
                raise BodyTooLarge(self.body_limit)
            if receipt is not None:
                receipt.add(len(chunk))
            body += chunk
        return body

    async def _inflate(self, compressed: bytearray, encoding: str, receipt: Receipt | None) -> bytes:
        """``compressed`` inflated step by step off the event loop, refused (413) as soon as it grows past the
        body limit, each step's bytes counted in the request's ``receipt`` before the next."""
        async with self._inflating:
            inflater = zlib.decompressobj(CONTENT_ENCODINGS[encoding])
            pieces: list[bytes] = []  # joined once at the end: a growing buffer would be copied as it grows
            inflated = 0
            view = memoryview(compressed)
            for start in range(0, len(view), INFLATE_INPUT_SLICE):
                pending = view[start : start + INFLATE_INPUT_SLICE]
                while pending and not inflater.eof:
                    try:
                        piece = await self.dataplane.off_loop(inflater.decompress, pending, INFLATE_STEP)
                    except zlib.error as error:
                        raise invalid(f"the request body is not valid {encoding} data ({error})") from None
                    inflated += len(piece)
                    if inflated > self.body_limit:
                        raise BodyTooLarge(self.body_limit, encoding)
                    if receipt is not None:
                        receipt.add(len(piece))
                    pieces.append(piece)
                    pending = inflater.unconsumed_tail
            if not inflater.eof:
                raise invalid(f"the request body ends inside its {encoding} stream")
            if receipt is not None:
                receipt.add(inflated)  # the joined copy, beside the pieces for a moment
            return b"".join(pieces)

    async def live(self, request):
        return web.Response(status=200)

    async def ready(self, request):
        return web.Response(status=200 if self.dataplane.reports_ready else 503)

    async def server_metadata(self, request):
        return json_response(describe.server_metadata(self.dataplane.shared_memory.allowed))

    async def model_metadata(self, request):
        served = self._resolve(request)
        ready_versions = self.dataplane.ready_versions(served.signature.name)
        return json_response(describe.model_metadata(served, ready_versions))

    async def model_ready(self, request):
        """200 ready; 400 not ready (the KServe REST spec's 4xx for false, Triton's 400); 404 an unknown name."""
        ready = self.dataplane.model_ready(request.match_info["name"], request.match_info.get("version", ""))
        return web.Response(status=200 if ready else 400)

    async def model_config(self, request):
        return json_response(describe.model_config(self._resolve(request)))

    async def statistics(self, request):
        served = self.dataplane.statistics_of(request.match_info.get("name", ""), request.match_info.get("version", ""))
        return json_response({"model_stats": [describe.model_statistics(m) for m in served]})

    async def repository_index(self, request):
        body = await self._body(request)
        try:
            ready = bool((orjson.loads(body) if body else {}).get("ready", False))
        except (orjson.JSONDecodeError, AttributeError):
            raise invalid('the index request body must be a JSON object like {"ready": true}') from None
        return json_response(describe.repository_index(self.dataplane.index(ready_only=ready)))

    async def load(self, request):
        body = await self._body(request)
        try:
            parameters = (orjson.loads(body) if body else {}).get("parameters") or {}
        except (orjson.JSONDecodeError, AttributeError):
            raise invalid("the load request body must be a JSON object") from None
        if not isinstance(parameters, dict):
            raise invalid(f"the load request's parameters must be a JSON object, got {type(parameters).__name__}")
        await self.dataplane.load_model(request.match_info["name"], list(parameters))
        return web.Response(status=200)

    async def unload(self, request):
        await self._body(request)
        await self.dataplane.unload_model(request.match_info["name"])
        return web.Response(status=200)

    async def trace_setting(self, request):
        """Triton's trace extension: GET the settings, POST ``{"trace_rate": "1", "trace_level": ["TIMESTAMPS"],
        "trace_count": null, ...}`` to change them (null: back to the global value, or the default)."""
        changes = {}
        if request.method == "POST":
            body = await self._body(request)
            try:
                given = orjson.loads(body) if body else {}
            except orjson.JSONDecodeError as error:
                raise invalid(f"the trace settings are not JSON: {error}") from None
            if not isinstance(given, dict):
                raise invalid(f"the trace settings must be a JSON object, got {type(given).__name__}")
            for name, value in given.items():
                if value is None:
                    changes[name] = []
                elif isinstance(value, list) and all(_word(v) for v in value):
                    changes[name] = [str(v) for v in value]
                elif _word(value):
                    changes[name] = [str(value)]
                else:
                    raise invalid(
                        f"trace setting {quoted(name)}: expected a string, a list of strings or null, "
                        f"got {quoted(value)}"
                    )
        settings = self.dataplane.trace_settings(request.match_info.get("name", ""), changes)
        answer = {name: values if name == "trace_level" else values[0] for name, values in settings.items()}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def shared_memory_status(self, request):
        region, shared_memory = request.match_info.get("region", ""), self.dataplane.shared_memory
        if request.path.startswith("/v2/cuda"):
            return json_response(shared_memory.cuda_status(_peer(request), region))
        return json_response(describe.shared_memory_status(shared_memory.status(_peer(request), region)))

    async def shared_memory_register(self, request):
        """``{"key": "/name", "offset": 0, "byte_size": N}`` (CUDA: refused, see SharedMemoryRegistry.cuda_refused)."""
        body = await self._body(request)
        if request.path.startswith("/v2/cuda"):
            raise self.dataplane.shared_memory.cuda_refused()
        try:
            given = orjson.loads(body) if body else None
        except orjson.JSONDecodeError as error:
            raise invalid(f"the register request is not JSON: {error}") from None
        if not isinstance(given, dict) or "key" not in given or "byte_size" not in given:
            raise invalid(
                'the register request must be a JSON object like {"key": "/name", "offset": 0, "byte_size": N}'
            )
        region = request.match_info["region"]
        peer = _peer(request)
        self.dataplane.shared_memory.register(peer, region, given["key"], given.get("offset", 0), given["byte_size"])
        return web.Response(status=200)

    async def shared_memory_unregister(self, request):
        await self._body(request)
        region, shared_memory = request.match_info.get("region", ""), self.dataplane.shared_memory
        if request.path.startswith("/v2/cuda"):
            shared_memory.cuda_status(_peer(request))  # no CUDA region is ever registered: nothing to do
        else:
            shared_memory.unregister(_peer(request), region)
        return web.Response(status=200)

    async def api_document(self, request):
        served = self.dataplane.served_models()
        return json_response(openapi.document(served[0].signature.d_model if served else 512))

    async def api_page(self, request):
        return web.Response(text=API_PAGE, content_type="text/html")

    def _resolve(self, request):
        return self.dataplane.resolve(request.match_info["name"], request.match_info.get("version", ""))

    async def infer(self, request: web.Request):
        name, version = request.match_info["name"], request.match_info.get("version", "")
        route = request.match_info.route.resource.canonical
        async with self.dataplane.inference("http", None, route, lambda: request.headers, _peer(request)) as call:
            header_length = header_length_of(request.headers.get(HEADER_LENGTH))  # before the body is read
            body = await self._body(request, call.receipt)
            call.bytes_in = request.content_length or len(body)  # as sent: compressed, if it was
            payload, json_length = await infer_rest(call, name, version, body, header_length)
            call.deliver_later()
        if json_length is None:
            response = web.Response(body=payload, content_type="application/json")
        else:
            response = web.Response(
                body=payload, content_type="application/octet-stream", headers={HEADER_LENGTH: str(json_length)}
            )
        delivered = False
        try:
            delivered = await self._send(request, response)
        finally:
            call.sent(delivered, len(payload))  # the answer leaves the memory budget only now
        return response

    async def _send(self, request: web.Request, response: web.Response) -> bool:
        """Write the answer within write_timeout_s: a client that does not read it is dropped, and the answer
        with it, instead of holding its memory for as long as it likes."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await response.prepare(request)
                await response.write_eof()
            return True
        except TimeoutError:
            log.info(
                "dropped an HTTP client that did not read its %d-byte answer within %g s",
                response.content_length or 0,
                self.write_timeout_s,
            )
        except ConnectionError:  # it went away first
            pass
        if request.transport is not None:
            request.transport.abort()
        return False
