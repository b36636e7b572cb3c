"""Steps of a sequence reach the worker that holds it, whichever worker their connection reached.

With ``--workers``, the kernel spreads connections over the workers, and a sequence's keys and values live in one
of them. Every sequence therefore has a home worker, the same for all of its steps and known to every worker
without asking: a stable hash of its owner where callers are told apart (named tokens, client certificates), so
that one caller's sequences share a worker and its ``--max-sequences-per-client`` and
``--max-sequence-bytes-per-client`` shares hold for the whole server; a stable hash of its id where they are not,
so that anonymous sequences spread over the workers. A step that reaches another worker is forwarded home over a
Unix socket (in a folder only the server's user may enter) and answered from there: one request and its answer
pickled each way. A forward moves a step's new rows and its answer, a few kilobytes; keeping the caches in shared
memory instead would share every sequence's keys, values and bookkeeping between processes under one lock. What
a forward costs is in BENCHMARKS.md, "Sequences across worker processes".

The home worker runs the step as its own call (its statistics, metrics, access log and trace count it there); the
worker that forwarded it counts it as forwarded. A home worker that is restarting cannot be reached: its sequences
are lost with it, and the step is answered UNAVAILABLE saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import os
import pickle
import struct
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ErrorKind, RequestError
from .inference import InferenceRequest, InferenceResponse, RequestedOutput

if TYPE_CHECKING:
    from .dataplane import DataPlane, InferenceCall

log = logging.getLogger("mhaserve.server")

SOCKETS_ENV = "MHASERVE_WORKER_SOCKETS"  # every worker's forward socket, in worker order
_LENGTH = struct.Struct("!Q")
FORWARD_GRACE_S = 5.0  # past the call's own deadline: the home worker answers DEADLINE_EXCEEDED itself first


def home_of(caller: str, sequence_id: int | str, workers: int) -> int:
    """The worker a sequence lives in: by its owner where callers are told apart, else by its id. A stable hash,
    the same in every worker (Python's own string hash differs from process to process)."""
    key = f"caller\0{caller}" if caller else f"id\0{type(sequence_id).__name__}\0{sequence_id}"
    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % workers


class StepForwarder:
    """What a worker does for a step whose sequence lives in another: finds its home, and forwards it there."""

    def __init__(self, own: int, sockets: list[str]):
        self.own, self.sockets = own, sockets
        self._idle: dict[int, list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]] = {}

    @classmethod
    def from_env(cls, own: int) -> StepForwarder | None:
        sockets = [path for path in os.environ.get(SOCKETS_ENV, "").split(",") if path]
        return cls(own, sockets) if len(sockets) > 1 else None

    def home_elsewhere(self, request: InferenceRequest, caller: str) -> int | None:
        """The worker to forward ``request`` to, or None where it is answered here: a step of a sequence that
        lives in another worker (a step whose parameters are malformed is refused here)."""
        try:
            step = request.sequence_step
        except RequestError:
            return None
        if step is None or request.shared_inputs:
            return None
        home = home_of(caller, step.id, len(self.sockets))
        return None if home == self.own else home

    async def infer(self, home: int, request: InferenceRequest, call: InferenceCall) -> InferenceResponse:
        """``request`` answered by worker ``home`` as a call of ``call``'s caller, protocol and deadline."""
        sent = {
            "request": _portable(request),
            "protocol": call.protocol,
            "method": call.method,
            "timeout_s": call.timeout_s,
            "peer": call.peer,
            "caller": call.caller,
        }
        timeout = None if call.timeout_s is None else call.timeout_s + FORWARD_GRACE_S
        try:
            reply = await asyncio.wait_for(self._exchange(home, sent), timeout)
        except (OSError, asyncio.IncompleteReadError) as error:
            raise RequestError(
                ErrorKind.UNAVAILABLE,
                f"sequence {request.sequence_step.id!r} lives in worker {home} of this server, which cannot be reached "
                f"({type(error).__name__}): it is restarting, and its sequences were lost with it; start the "
                "sequence again with sequence_start",
            ) from None
        except asyncio.TimeoutError:
            raise RequestError(
                ErrorKind.DEADLINE_EXCEEDED, f"worker {home}, where the sequence lives, did not answer in time"
            ) from None
        if reply["error"] is not None:
            kind, message, retry_after_s = reply["error"]
            raise RequestError(ErrorKind[kind], message, retry_after_s)
        return InferenceResponse(reply["signature"], request, reply["outputs"])

    async def _exchange(self, home: int, sent: dict) -> dict:
        """One request and its reply over a connection to ``home`` (kept for the next where the exchange ends)."""
        idle = self._idle.setdefault(home, [])
        reader, writer = idle.pop() if idle else await asyncio.open_unix_connection(self.sockets[home])
        try:
            await _write(writer, sent)
            reply = await _read(reader)
        except BaseException:
            writer.close()
            raise
        idle.append((reader, writer))
        return reply

    def close(self) -> None:
        for connections in self._idle.values():
            for _, writer in connections:
                writer.close()
        self._idle.clear()


async def serve_forwarded(dataplane: DataPlane, path: str) -> asyncio.AbstractServer:
    """The Unix socket at ``path`` on which this worker answers the steps other workers forward to it."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by this worker's previous process

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                sent = await _read(reader)
                await _write(writer, await _answer(dataplane, sent))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the other worker closed it (or exited)
        finally:
            writer.close()

    server = await asyncio.start_unix_server(connection, path)
    os.chmod(path, 0o600)
    return server


async def _answer(dataplane: DataPlane, sent: dict) -> dict:
    """A forwarded request run here as a call of its own; its outputs, or why it was refused."""
    request: InferenceRequest = sent["request"]
    try:
        async with dataplane.inference(
            sent["protocol"], sent["timeout_s"], sent["method"], None, sent["peer"], sent["caller"]
        ) as call:
            response = await call.infer(request)
            with call.encoding():  # pickled below: the answer leaves the budget once written
                pass
        return {"error": None, "signature": response.model, "outputs": response.outputs}
    except RequestError as error:
        return {"error": (error.kind.name, error.message, error.retry_after_s)}


def _portable(request: InferenceRequest) -> InferenceRequest:
    """The request with its parameters as plain dicts (a read-only mapping does not pickle)."""
    outputs = tuple(RequestedOutput(o.name, dict(o.parameters)) for o in request.outputs)
    return dataclasses.replace(request, parameters=dict(request.parameters), outputs=outputs)


async def _write(writer: asyncio.StreamWriter, message: dict) -> None:
    data = pickle.dumps(message, protocol=5)
    writer.write(_LENGTH.pack(len(data)) + data)
    await writer.drain()


async def _read(reader: asyncio.StreamReader) -> dict:
    (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
    return pickle.loads(await reader.readexactly(length))


def socket_paths(folder: Path, count: int) -> list[str]:
    return [str(folder / f"worker-{index}.sock") for index in range(count)]
