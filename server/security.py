"""Who may talk to the server: TLS (optionally mutual) for the port, and a bearer token on every RPC.

The token is checked before the request message is even decoded, so a refused call costs no model
work. Health (grpc.health.v1) stays open: orchestrators probe it without credentials, and it says
nothing but SERVING or NOT_SERVING.
"""

from __future__ import annotations

import hmac
import logging
import os
import ssl
from pathlib import Path

import grpc

log = logging.getLogger("mhaserve.server")

TOKEN_ENV = "MHASERVE_AUTH_TOKEN"  # the token itself; never a flag, which `ps` would show
OPEN_SERVICES = ("/grpc.health.v1.Health/",)


class SecurityConfigError(ValueError):
    pass


def _read(path: Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise SecurityConfigError(f"cannot read the {what} {path}: {error.strerror}") from None


def server_credentials(cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None):
    """TLS credentials for the port, or None for plain text. A client CA turns on mutual TLS."""
    if cert_file is None and key_file is None:
        if client_ca_file is not None:
            raise SecurityConfigError("--tls-client-ca-file needs --tls-cert-file and --tls-key-file")
        return None
    if cert_file is None or key_file is None:
        raise SecurityConfigError("TLS needs both --tls-cert-file and --tls-key-file")
    cert, key = _read(cert_file, "TLS certificate"), _read(key_file, "TLS key")
    client_ca = _read(client_ca_file, "client CA bundle") if client_ca_file is not None else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def load_token(token_file: Path | None) -> bytes | None:
    """The bearer token from ``token_file`` or $MHASERVE_AUTH_TOKEN (surrounding whitespace dropped); None: no auth."""
    if token_file is not None:
        token = _read(token_file, "token file").strip()
        source = str(token_file)
    else:
        token = os.environ.get(TOKEN_ENV, "").strip().encode()
        source = "$" + TOKEN_ENV
        if not token:
            return None
    if not token:
        raise SecurityConfigError(f"the bearer token from {source} is empty")
    return token


def bearer_token_matches(authorization: str | bytes, token: bytes) -> bool:
    """An ``Authorization`` value (gRPC metadata or HTTP header) that carries ``Bearer <token>``."""
    value = authorization.encode() if isinstance(authorization, str) else authorization
    scheme, _, credentials = value.partition(b" ")
    # The scheme is case-insensitive (RFC 7235); the token is compared in constant time, so its
    # bytes cannot be guessed one by one from response times.
    return scheme.lower() == b"bearer" and hmac.compare_digest(credentials.strip(), token)


def server_ssl_context(cert_file: Path | None, key_file: Path | None, client_ca_file: Path | None):
    """The same TLS as ``server_credentials``, for the HTTP port: None for plain text."""
    server_credentials(cert_file, key_file, client_ca_file)  # the same checks and messages
    if cert_file is None:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file is not None:
        context.load_verify_locations(client_ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED, before any decoding, for a call without ``authorization: Bearer <token>``."""

    def __init__(self, token: bytes, on_refusal=None):
        self._token = token
        self._on_refusal = on_refusal or (lambda method: None)

    def _authorized(self, metadata) -> bool:
        presented = [value for key, value in (metadata or ()) if key == "authorization"]
        return len(presented) == 1 and bearer_token_matches(presented[0], self._token)

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        # None: an unknown method, which gRPC answers UNIMPLEMENTED.
        if handler is None or method.startswith(OPEN_SERVICES):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        self._on_refusal(method)
        return _refusing_handler(handler)


def _refusing_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    async def refuse(request_iterator, context):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'",
        )

    # Request-streaming whatever the method is: gRPC reads a unary request whole before its handler runs,
    # a streaming one only when the handler asks, and this one never asks. So a refused call's message
    # is never received (beyond HTTP/2's flow-control window), let alone parsed: read first, large
    # unauthenticated requests took hundreds of MB (BENCHMARKS.md, "Figures behind the server's defaults").
    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.stream_unary_rpc_method_handler(refuse)
