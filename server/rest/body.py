"""Bodies on the HTTP connection. A request's is read within a time limit and a size limit, inflated (gzip, deflate)
step by step off the event loop, and counted in the request's receipt as it arrives, so that a body the memory
budget cannot hold is refused before it is read whole; an answer's is written within a time limit, so that a
client that does not read it cannot hold its memory."""

from __future__ import annotations

import asyncio
import logging
import zlib

from aiohttp import web

from ..accounting import Receipt
from ..errors import ErrorKind, RequestError, invalid

log = logging.getLogger("mhaserve.server")


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


class Bodies:
    """The bodies of one HTTP port: requests of at most ``body_limit`` bytes both ways, arriving within
    ``read_timeout_s`` (``off_loop`` runs a step of inflating off the event loop); answers written within
    ``write_timeout_s``."""

    def __init__(self, body_limit: int, read_timeout_s: float, write_timeout_s: float, off_loop):
        self.body_limit = body_limit
        self.read_timeout_s = read_timeout_s
        self.write_timeout_s = write_timeout_s
        self._off_loop = off_loop
        self._inflating = asyncio.Semaphore(INFLATING_AT_ONCE)

    async def read(self, request: web.Request, receipt: Receipt | None = None) -> bytes | bytearray:
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

    async def send(self, request: web.Request, response: web.Response) -> bool:
        """Write the answer within write_timeout_s: a client that does not read it is dropped, and the answer
        with it, instead of holding its memory for as long as it likes. Whether it was written whole."""
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

    async def _receive(self, request: web.Request, receipt: Receipt | None) -> bytearray:
        declared = request.content_length
        if declared is not None and declared > self.body_limit:
            raise BodyTooLarge(self.body_limit)  # before a byte of it is read
        if declared is not None:
            if receipt is not None:
                receipt.add(declared)
            # Grown as the bytes come (a large buffer grows in place: glibc remaps it), not allocated at the declared
            # size: zeroing the declared size for a client that declares much and sends little would hold the event
            # loop and the memory at once.
            body = bytearray()
            async for chunk in request.content.iter_any():
                body += chunk
            if len(body) != declared:
                raise invalid(f"the request body ended after {len(body)} of its {declared} bytes (Content-Length)")
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
                        piece = await self._off_loop(inflater.decompress, pending, INFLATE_STEP)
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
