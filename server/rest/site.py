"""The listening side of the process's HTTP ports (HTTP/REST and metrics): aiohttp on the running loop,
with a cap on open connections and idle connections closed, so that idle or hostile clients cost bounded
sockets and memory however many of them connect.
"""

from __future__ import annotations

import asyncio
import socket

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

REFUSAL_LINGER_S = 1.0  # the refused client gets this long to read its 503 before the socket closes
TLS_HANDSHAKE_TIMEOUT_S = 10.0  # a connection still shaking hands is not yet counted by aiohttp: bound it


def _refusal(limit: int, what: str) -> bytes:
    body = orjson.dumps(
        {"error": f"{limit} {what} connections are open, the limit; retry later, or reuse a connection"}
    )
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        f"Connection: close\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class _OverCapConnection(asyncio.Protocol):
    """A connection over the cap: answered 503 at once, whatever it sends, then closed."""

    def __init__(self, response: bytes):
        self.response = response

    def connection_made(self, transport):
        transport.write(self.response)
        # Closing at once could reset the connection before the client reads the answer (its request
        # is still unread here): let it read for a moment.
        asyncio.get_running_loop().call_later(REFUSAL_LINGER_S, transport.close)

    def data_received(self, data):
        pass


class _RequestHandler(RequestHandler):
    """aiohttp's connection handler, answering bytes that do not parse as HTTP with a JSON error that names
    the fault without quoting them (aiohttp's own text echoes them: for a Content-Length shorter than its
    body, the body's tail)."""

    __slots__ = ()

    def handle_error(self, request, status=500, exc=None, message=None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        fault = (exc.message or type(exc).__name__).splitlines()[0].rstrip(": ")
        response = web.json_response(
            {"error": f"the request is not valid HTTP/1.1 ({fault}); if it had a body, check its Content-Length"},
            status=exc.code or 400,
        )
        response.force_close()
        return response


class CappedSite(web.TCPSite):
    """aiohttp's TCP site, answering 503 to connections beyond ``max_connections`` instead of serving them."""

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        ssl_context,
        max_connections: int,
        what: str,
        handler,
        reuse_port: bool = False,
    ):
        super().__init__(runner, host, port, ssl_context=ssl_context, reuse_port=reuse_port or None)
        self._max_connections = max_connections
        self._refusal = _refusal(max_connections, what)
        self._handler = handler  # keyword arguments of each connection's _RequestHandler

    def _protocol(self) -> asyncio.Protocol:
        server = self._runner.server
        if len(server.connections) >= self._max_connections:
            return _OverCapConnection(self._refusal)
        return _RequestHandler(server, loop=asyncio.get_running_loop(), **self._handler)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (cleanup stops it)
        loop = asyncio.get_running_loop()
        where = {"host": self._host, "port": self._port, "reuse_port": self._reuse_port}
        if self._host in IPV6_ANY:  # one socket for both families, as gRPC binds [::] (asyncio's is IPv6 only)
            where = {"sock": dual_stack_socket(self._port, self._reuse_port)}
        self._server = await loop.create_server(
            self._protocol,
            ssl=self._ssl_context,
            ssl_handshake_timeout=TLS_HANDSHAKE_TIMEOUT_S if self._ssl_context else None,
            **where,
        )
        self._bound_port = self._server.sockets[0].getsockname()[1]


IPV6_ANY = ("::", "[::]")


def dual_stack_socket(port: int, reuse_port: bool) -> socket.socket:
    """A listening socket on every address of both families: IPv6's any address with IPv4 mapped into it."""
    sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(("::", port))
        sock.listen(100)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


async def start_site(
    app: web.Application,
    host: str,
    port: int,
    *,
    ssl_context=None,
    max_connections: int,
    idle_timeout_s: float,
    shutdown_timeout_s: float = 0.0,
    what: str,
    reuse_port: bool = False,
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on host:port; returns its runner (``cleanup()`` stops it) and the bound port."""
    # keepalive_timeout also closes a connection that never sends; compressed bodies are inflated by the routes,
    # in bounded steps off the event loop (aiohttp's parser would inflate them whole, on it).
    handler = {"access_log": None, "keepalive_timeout": idle_timeout_s, "auto_decompress": False}
    runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=shutdown_timeout_s, **handler)
    await runner.setup()
    site = CappedSite(
        runner,
        host,
        port,
        ssl_context=ssl_context,
        max_connections=max_connections,
        what=what,
        handler=handler,
        reuse_port=reuse_port,
    )
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner, site.port
