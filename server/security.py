"""Who may talk to the server: TLS (optionally mutual) for the port, and a bearer token on every RPC.

The token is checked before the request message is even decoded, so a refused call costs no model
work. Health (grpc.health.v1) stays open: orchestrators probe it without credentials, and it says
nothing but SERVING or NOT_SERVING.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import ssl
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Tokens:
    """The bearer tokens the server takes, each with its holder's name: one token without a name (every holder
    is the same caller, as with one shared secret), or one per client, ``NAME TOKEN`` a line, so that callers can
    be told apart (a sequence answers only the caller that started it)."""

    # token -> its holder's name ("" for a single unnamed token): one dict lookup a call whatever the number of
    # tokens. Python hashes strings with a key drawn at random per process (SipHash), so a caller cannot steer a
    # lookup toward a real token, and a presented token is compared byte by byte only with one of equal hash.
    holders: dict[str, str]

    def holder(self, authorization: str | bytes) -> str | None:
        """The name of the token an ``Authorization`` value (gRPC metadata or HTTP header) carries as
        ``Bearer <token>``; None when it carries none of them."""
        if isinstance(authorization, bytes):
            authorization = authorization.decode("utf-8", "replace")
        scheme, _, presented = authorization.partition(" ")
        if scheme.lower() != "bearer":  # case-insensitive (RFC 7235)
            return None
        return self.holders.get(presented.strip())

    def holder_of(self, values) -> str | None:
        """The holder named by exactly one ``authorization`` value among ``values``; None otherwise."""
        return self.holder(values[0]) if len(values) == 1 else None

    @property
    def named(self) -> bool:
        return any(self.holders.values())


# A file of 'NAME TOKEN' lines and blank ones, nothing else: read in one pass of the regular expression engine and
# one str.split (a million lines in under 2 s here, against 4 s line by line); any other file line by line.
_NAMED_LINES = re.compile(r"(?:[^\S\n]*(?:\S+[^\S\n]+\S+[^\S\n]*)?\n)*[^\S\n]*(?:\S+[^\S\n]+\S+[^\S\n]*)?")


def load_token(token_file: Path | None) -> Tokens | None:
    """The bearer tokens from ``token_file`` (one token, or ``NAME TOKEN`` lines; ``#`` starts a comment; UTF-8,
    with or without a byte-order mark, any line ends) or the one token in $MHASERVE_AUTH_TOKEN (surrounding
    whitespace dropped); None: no auth. Linear in the file's size."""
    if token_file is not None:
        raw = _read(token_file, "token file")
        source = str(token_file)
    else:
        raw = os.environ.get(TOKEN_ENV, "").strip().encode()
        source = "$" + TOKEN_ENV
        if not raw:
            return None
    try:
        text = raw.decode("utf-8-sig")  # an editor's byte-order mark is not part of the first token
    except UnicodeDecodeError as error:
        raise SecurityConfigError(f"{source}: not UTF-8 text (byte {error.start})") from None
    if "#" not in text and _NAMED_LINES.fullmatch(text):
        words = text.split()
        names, tokens = words[0::2], words[1::2]
        holders = dict(zip(tokens, names, strict=True))
        if tokens and len(holders) == len(tokens) and len(set(names)) == len(names):
            return Tokens(holders)
    return _tokens_line_by_line(text, source)  # comments, one token alone, or a line to name as wrong


def _tokens_line_by_line(text: str, source: str) -> Tokens:
    lines = [line.split() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        raise SecurityConfigError(f"the bearer token from {source} is empty")
    if len(lines) == 1 and len(lines[0]) == 1:
        return Tokens({lines[0][0]: ""})
    names: dict[str, str] = {}
    named: set[str] = set()  # each name once: a set beside the dict, not a scan of it
    for number, fields in enumerate(lines, 1):
        if len(fields) != 2:
            raise SecurityConfigError(
                f"{source}: line {number} of the tokens: expected 'NAME TOKEN' (one client a line), got {len(fields)} "
                "words"
            )
        name, token = fields
        if token in names:
            raise SecurityConfigError(f"{source}: clients {names[token]!r} and {name!r} have the same token")
        if name in named:
            raise SecurityConfigError(f"{source}: the client name {name!r} is given twice")
        names[token] = name
        named.add(name)
    return Tokens(names)


@functools.lru_cache(maxsize=4096)  # a client presents the same certificate on every call
def certificate_identity(encoded: bytes) -> str:
    """Who a verified client certificate (PEM, as gRPC gives it, or DER, as ssl does) names, "" for none. In this
    order, as Envoy and SPIFFE take a workload's identity: its first URI SAN (a SPIFFE ID, as it is), else its
    first DNS SAN (``DNS:name``), else its whole subject (RFC 4514, ``O=Acme,CN=alice``: never the common name
    alone, which two certificates of different organisations may share), else, for a certificate that names
    nothing, its own SHA-256 fingerprint (``sha256:...``): every certificate is someone, never everyone."""
    if not encoded:
        return ""
    from cryptography import x509  # only servers under mutual TLS come here
    from cryptography.hazmat.primitives import hashes

    if encoded.lstrip().startswith(b"-----"):
        certificate = x509.load_pem_x509_certificate(encoded)
    else:
        certificate = x509.load_der_x509_certificate(encoded)
    try:
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = None
    if names is not None:
        if uris := names.get_values_for_type(x509.UniformResourceIdentifier):
            return uris[0]
        if dns := names.get_values_for_type(x509.DNSName):
            return f"DNS:{dns[0]}"
    if subject := certificate.subject.rfc4514_string():
        return subject
    return "sha256:" + certificate.fingerprint(hashes.SHA256()).hex()


@dataclass(frozen=True)
class Callers:
    """How the server tells its callers apart, to whom the state a call creates (a sequence) belongs: by the name
    of the token a call carries (named tokens), else by its client certificate's identity (mutual TLS:
    ``certificate_identity``). With neither (no auth, or one shared token) every caller is the same one, "", and
    sequence ids are global as in Triton."""

    tokens: Tokens | None = None
    certificates: bool = False  # mutual TLS: every caller presents a certificate the client CA signed

    @property
    def told_apart(self) -> bool:
        return self.certificates or (self.tokens is not None and self.tokens.named)

    def identify(self, authorization_values, certificate: str) -> str:
        """The caller of a call that presented ``authorization_values`` and a certificate whose identity is
        ``certificate`` (``certificate_identity``)."""
        holder = self.tokens.holder_of(authorization_values) if self.tokens is not None else None
        if holder:
            return f"token {holder}"
        return f"certificate {certificate}" if certificate else ""


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

    def __init__(self, tokens: Tokens, on_refusal=None):
        self._tokens = tokens
        self._on_refusal = on_refusal or (lambda method: None)

    def _authorized(self, metadata) -> bool:
        presented = [value for key, value in (metadata or ()) if key == "authorization"]
        return self._tokens.holder_of(presented) is not None

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
