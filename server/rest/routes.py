"""HTTP/REST transport: the Open Inference Protocol's REST routes (KServe v2) with Triton's extensions, on the
same asyncio loop and data plane as gRPC. Bodies are read by ``body.py``, requests and answers written by
``codec.py``; every rule about the tensors is ``tensors.py``'s, every decision the data plane's. Refusals are
its RequestError kinds as HTTP statuses, with the gRPC status's message text in ``{"error": ...}``.
"""

from __future__ import annotations

import logging
import math

import aiohttp_cors
import orjson
import swagger_ui_bundle
from aiohttp import web

from mhaserve.contract.errors import json_kind

from .. import describe
from ..dataplane import DataPlane
from ..errors import HTTP_STATUS, RequestError, invalid
from ..parameters import quoted
from ..security import Callers, certificate_identity
from . import openapi
from .body import Bodies
from .codec import HEADER_LENGTH, header_length_of, infer_rest

log = logging.getLogger("mhaserve.server")

RETRY_AFTER_S = 1  # 429 and 503: the queue, the memory budget or loading; worth retrying shortly
OPEN_PATHS = ("/v2/health/live", "/v2/health/ready")  # probes need no token, as grpc.health.v1
# What a page's script may send and read across origins (--http-cors-origins): the protocol's headers, the token,
# and a trace context; the binary extension's header length and a refusal's Retry-After.
CORS_REQUEST_HEADERS = ("Authorization", "Content-Type", "Content-Encoding", HEADER_LENGTH, "traceparent", "tracestate")
CORS_RESPONSE_HEADERS = (HEADER_LENGTH, "Retry-After")
CORS_MAX_AGE_S = 600  # a browser asks again for a route's rules after this
API_PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><title>mhaserve REST API</title>
<link rel="stylesheet" href="/v2/docs/static/swagger-ui.css"></head>
<body><div id="swagger-ui"></div><script src="/v2/docs/static/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/v2/docs/openapi.json", dom_id: "#swagger-ui"});</script></body></html>
"""


def error_response(status: int, message: str, retry_after_s: float | None = None) -> web.Response:
    """``retry_after_s``: when the refusal says a retry may succeed (a drain: once the port has closed)."""
    headers = None
    if status in (429, 503):
        headers = {"Retry-After": str(RETRY_AFTER_S if retry_after_s is None else math.ceil(retry_after_s))}
    if status == 401:
        headers = {"WWW-Authenticate": "Bearer"}
    return web.Response(
        status=status, body=orjson.dumps({"error": message}), content_type="application/json", headers=headers
    )


def json_response(value, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), content_type="application/json")


# -- the routes ------------------------------------------------------------------------------------------


def _peer(request: web.Request) -> str:
    """The caller's address as aiohttp saw it ("" where it cannot tell)."""
    return request.remote or ""


def _is_trace_value(value) -> bool:
    """A trace setting's value: a string, or an integer written as one."""
    return isinstance(value, str | int) and not isinstance(value, bool)


class RestTransport:
    def __init__(
        self,
        dataplane: DataPlane,
        callers: Callers | None,
        body_limit: int,
        read_timeout_s: float,
        write_timeout_s: float,
        cors_origins: list[str] = (),
    ):
        self.dataplane = dataplane
        self.cors_origins = list(cors_origins)
        self.callers = callers or Callers()
        self.tokens = self.callers.tokens
        self.body_limit = body_limit
        self._bodies = Bodies(body_limit, read_timeout_s, write_timeout_s, dataplane.off_loop)

    def application(self) -> web.Application:
        app = web.Application(client_max_size=self.body_limit, middlewares=[self._errors, self._authenticate])
        for method, path, handler in openapi.operations():  # the documented operations, and only they
            if method == "GET":
                app.router.add_get(path, getattr(self, handler))  # HEAD too
            else:
                app.router.add_route(method, path, getattr(self, handler))
        app.add_routes(
            [
                # The API's OpenAPI document and Swagger UI over it, from the installed package's files.
                web.get("/v2/docs", self.api_page),
                web.get("/v2/docs/openapi.json", self.api_document),
                web.static("/v2/docs/static", swagger_ui_bundle.swagger_ui_path),
            ]
        )
        if self.cors_origins:
            rules = aiohttp_cors.ResourceOptions(
                allow_credentials=False,  # a token is sent as a header a page's script sets, not as a cookie
                allow_headers=CORS_REQUEST_HEADERS,
                expose_headers=CORS_RESPONSE_HEADERS,
                max_age=CORS_MAX_AGE_S,
            )
            cors = aiohttp_cors.setup(app, defaults=dict.fromkeys(self.cors_origins, rules))
            for route in list(app.router.routes()):
                if not isinstance(route.resource, web.StaticResource):  # Swagger UI's files: same-origin only
                    cors.add(route)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """Every refusal as JSON: the data plane's kinds, and aiohttp's own (404 route, 405, 413 body)."""
        try:
            return await handler(request)
        except RequestError as error:
            status = getattr(error, "http_status", HTTP_STATUS[error.kind])
            return error_response(status, error.message, error.retry_after_s)
        except web.HTTPException as error:
            if error.status < 400:
                raise
            return error_response(error.status, f"{error.reason}: {request.method} {request.path}")

    @web.middleware
    async def _authenticate(self, request: web.Request, handler):
        """Before the body is read: a refused request costs its headers, not its body."""
        if self.tokens is None or request.path in OPEN_PATHS or self._is_preflight(request):
            return await handler(request)
        if self.tokens.holder_of(request.headers.getall("Authorization", [])) is not None:
            return await handler(request)
        self.dataplane.record_unauthenticated(request.path)
        return error_response(401, "missing or wrong bearer token: send the header 'Authorization: Bearer <token>'")

    def _is_preflight(self, request: web.Request) -> bool:
        """A browser's CORS preflight: it carries no token (the request it asks about will), and answers only what
        the route allows."""
        return (
            bool(self.cors_origins)
            and request.method == "OPTIONS"
            and "Access-Control-Request-Method" in request.headers
        )

    def _caller(self, request: web.Request) -> str:
        """Who the request comes from (security.Callers): "" unless the server tells callers apart."""
        if not self.callers.told_apart:
            return ""
        tls = request.transport.get_extra_info("ssl_object") if request.transport is not None else None
        certificate = (tls.getpeercert(binary_form=True) if tls is not None else None) or b""
        return self.callers.identify(request.headers.getall("Authorization", []), certificate_identity(certificate))

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
        name, version = request.match_info.get("name", ""), request.match_info.get("version", "")
        return json_response({"model_stats": await self.dataplane.statistics(name, version)})

    async def repository_index(self, request):
        body = await self._bodies.read(request)
        try:
            ready = (orjson.loads(body) if body else {}).get("ready", False)
        except (orjson.JSONDecodeError, AttributeError):
            raise invalid('the index request body must be a JSON object like {"ready": true}') from None
        if not isinstance(ready, bool):
            raise invalid(f"the index request's 'ready' must be true or false, got a JSON {json_kind(ready)}")
        return json_response(describe.repository_index(self.dataplane.index(ready_only=ready)))

    async def load(self, request):
        parameters = await self._control_parameters(request, "load")
        await self.dataplane.load_model(request.match_info["name"], parameters)
        return web.Response(status=200)

    async def unload(self, request):
        parameters = await self._control_parameters(request, "unload")
        await self.dataplane.unload_model(request.match_info["name"], parameters)
        return web.Response(status=200)

    async def _control_parameters(self, request, action: str) -> dict:
        """A load or unload request's parameters: its body a JSON object (or none), theirs one too."""
        parameters = (await self._json_object(request, f"the {action} request body")).get("parameters") or {}
        if not isinstance(parameters, dict):
            raise invalid(f"the {action} request's parameters must be a JSON object, got {json_kind(parameters)}")
        return parameters

    async def trace_setting(self, request):
        """Triton's trace extension: GET the settings, POST ``{"trace_rate": "1", "trace_level": ["TIMESTAMPS"],
        "trace_count": null, ...}`` to change them (null: back to the global value, or the default)."""
        changes = {}
        for name, value in (await self._settings_changes(request, "trace settings")).items():
            if value is None:
                changes[name] = []
            elif isinstance(value, list) and all(_is_trace_value(v) for v in value):
                changes[name] = [str(v) for v in value]
            elif _is_trace_value(value):
                changes[name] = [str(value)]
            else:
                raise invalid(
                    f"trace setting {quoted(name)}: expected a string, a list of strings or null, got {quoted(value)}"
                )
        settings = self.dataplane.trace_settings(request.match_info.get("name", ""), changes)
        answer = {name: values if name == "trace_level" else values[0] for name, values in settings.items()}
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def log_setting(self, request):
        """Triton's logging extension: GET the settings, POST ``{"log_verbose_level": 1, "log_info": false, ...}`` to
        change those named (the answer: every setting, as it is now)."""
        changes = await self._settings_changes(request, "log settings")
        return json_response(await self.dataplane.log_settings(changes))

    async def _settings_changes(self, request, what: str) -> dict:
        """A settings call's changes: a POST's body, a JSON object (none: no change); a GET's, none."""
        return await self._json_object(request, f"the {what} body") if request.method == "POST" else {}

    async def _json_object(self, request, what: str) -> dict:
        """The request's body, a JSON object (an empty body: an empty one); ``what`` names it in a refusal."""
        body = await self._bodies.read(request)
        try:
            value = orjson.loads(body) if body else {}
        except orjson.JSONDecodeError as error:
            raise invalid(f"{what} is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise invalid(f"{what} must be a JSON object, got {json_kind(value)}")
        return value

    async def shared_memory_status(self, request):
        region, shared_memory = request.match_info.get("region", ""), self.dataplane.shared_memory
        if request.path.startswith("/v2/cuda"):
            return json_response(shared_memory.cuda_status(_peer(request), region))
        regions = shared_memory.status(_peer(request), self._caller(request), region)
        return json_response(describe.shared_memory_status(regions))

    async def shared_memory_register(self, request):
        """``{"key": "/name", "offset": 0, "byte_size": N}`` (CUDA: refused, see SharedMemoryRegistry.cuda_refused)."""
        body = await self._bodies.read(request)
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
        await self.dataplane.register_region(
            _peer(request), self._caller(request), region, given["key"], given.get("offset", 0), given["byte_size"]
        )
        return web.Response(status=200)

    async def shared_memory_unregister(self, request):
        await self._bodies.read(request)
        region, shared_memory = request.match_info.get("region", ""), self.dataplane.shared_memory
        if request.path.startswith("/v2/cuda"):
            shared_memory.cuda_status(_peer(request))  # no CUDA region is ever registered: nothing to do
        else:
            await self.dataplane.unregister_region(_peer(request), self._caller(request), region)
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
        caller = self._caller(request)
        async with self.dataplane.inference(
            "http", None, route, lambda: request.headers, _peer(request), caller
        ) as call:
            header_length = header_length_of(request.headers.get(HEADER_LENGTH))  # before the body is read
            body = await self._bodies.read(request, call.receipt)
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
            delivered = await self._bodies.send(request, response)
        finally:
            call.record_delivery(delivered, len(payload))  # the answer leaves the memory budget only now
        return response
