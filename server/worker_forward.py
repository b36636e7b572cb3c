"""Steps of a sequence reach the worker that holds it, whichever worker their connection reached.

With ``--workers``, the kernel spreads connections over the workers, and a sequence's keys and values live in one
of them. Every sequence therefore has a home worker, the same for all of its steps and known to every worker:
a stable hash of its owner where callers are told apart (named tokens, client certificates), so that one caller's
sequences share a worker and its ``--max-sequences-per-client`` and ``--max-sequence-bytes-per-client`` shares
hold for the whole server; where they are not, the worker that answered its first step, found by a link it keeps
(SequenceHomes), so that a client whose steps share a connection (a channel, a stream) is never forwarded. A step
that reaches another worker is forwarded home over a Unix socket (in a folder only the server's user may enter)
and answered from there: one request and its answer pickled each way. A forward moves a step's new rows and its
answer, a few kilobytes, and each sequence's state stays private to one process. What a forward costs, and what a
step on a cache kept in shared memory costs (no more than one on private memory: the faster mechanism per step,
were every sequence's bookkeeping shared as well, under locks a killed worker cannot leave held), is in
BENCHMARKS.md, "Worker processes".

The home worker runs the step as its own call (its statistics, metrics, access log and trace count it there); the
worker that forwarded it counts it as forwarded. A home worker that is restarting cannot be reached: its sequences
are lost with it, and the step is answered UNAVAILABLE saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mhaserve.contract.ring import point

from .errors import ErrorKind, RequestError
from .inference import InferenceRequest, InferenceResponse, RequestedOutput

if TYPE_CHECKING:
    from .dataplane import DataPlane, InferenceCall

log = logging.getLogger("mhaserve.server")

SOCKETS_ENV = "MHASERVE_WORKER_SOCKETS"  # every worker's forward socket, in worker order
_HEADER = struct.Struct("!QQ")  # a message's number, and its length
CONTROL_TIMEOUT_S = 600.0  # a load in another worker (its model's sessions and warm-up) answers within this
FORWARD_GRACE_S = 5.0  # past the call's own deadline: the home worker answers DEADLINE_EXCEEDED itself first


def home_of(caller: str, workers: int) -> int:
    """The worker a caller's sequences live in, where callers are told apart. A stable hash, the same in every
    worker (Python's own string hash differs from process to process)."""
    return point(f"caller\0{caller}") % workers


class SequenceHomes:
    """Where each anonymous sequence lives: a symbolic link per sequence in a folder every worker reads, named by a
    hash of its id and pointing at its worker's number. The worker that answers a sequence's first step makes it
    (a link is made or replaced in one step: no lock), and removes it once it has forgotten the sequence's end; a
    step reads it (one readlink)."""

    def __init__(self, folder: Path, own: int):
        self.folder, self.own = folder, own
        folder.mkdir(mode=0o700, exist_ok=True)

    def _link(self, sequence_id: int | str) -> Path:
        key = f"{type(sequence_id).__name__}\0{sequence_id}"
        return self.folder / f"{point(key):016x}"

    def of(self, sequence_id: int | str) -> int | None:
        """The worker holding the sequence (or that held it and remembers its end); None where none does."""
        try:
            return int(os.readlink(self._link(sequence_id)))
        except FileNotFoundError:
            return None

    def claim(self, sequence_id: int | str) -> None:
        """The sequence lives here from now on."""
        link = self._link(sequence_id)
        made = link.with_name(f"{link.name}.{self.own}")
        with contextlib.suppress(FileNotFoundError):
            made.unlink()
        os.symlink(str(self.own), made)
        os.replace(made, link)

    def release(self, sequence_id: int | str) -> None:
        """This worker no longer knows the sequence: its link goes, unless another worker's start has taken it."""
        with contextlib.suppress(FileNotFoundError):
            if self.of(sequence_id) == self.own:
                self._link(sequence_id).unlink()

    def taken_elsewhere(self, sequence_id: int | str) -> bool:
        """Whether another worker's start has taken the sequence (its link names that worker)."""
        home = self.of(sequence_id)
        return home is not None and home != self.own


class StepForwarder:
    """What a worker does for a step whose sequence lives in another: finds its home, and forwards it there."""

    def __init__(self, own: int, sockets: list[str]):
        self.own, self.sockets = own, sockets
        self._peers: dict[int, FramedConnection] = {}  # one connection to each home, its exchanges interleaved
        self.homes = SequenceHomes(Path(sockets[own]).parent / "homes", own)

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
        if caller:  # one home per caller: its shares hold for the whole server
            home = home_of(caller, len(self.sockets))
        else:  # where its first step was answered: none for a client whose steps share a connection
            home = self.homes.of(step.id)
        return None if home is None or home == self.own else home

    async def infer(self, home: int, request: InferenceRequest, call: InferenceCall) -> InferenceResponse | None:
        """``request`` answered by worker ``home`` as a call of ``call``'s caller, protocol and deadline; None for
        an anonymous sequence's start that cannot reach it (restarting, the sequence lost with it): it starts here."""
        sent = {
            "kind": "infer",
            "request": _portable(request),
            "protocol": call.protocol,
            "method": call.method,
            "timeout_s": call.timeout_s,
            "peer": call.peer,
            "caller": call.caller,
        }
        timeout = None if call.timeout_s is None else call.timeout_s + FORWARD_GRACE_S
        try:
            peer = await self._peer(home)
            reply = await asyncio.wait_for(peer.exchange(sent), timeout)
        except OSError as error:
            if request.sequence_step.start and not call.caller:
                return None
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

    async def tell_others(self, action: str, **arguments) -> list[str]:
        """A control call made in every other worker at once (dataplane.DataPlane.load_model and the like): why it
        failed in any, one line each ("worker i: ...")."""
        others = [index for index in range(len(self.sockets)) if index != self.own]
        replies = await asyncio.gather(*(self._control(index, action, arguments) for index in others))
        return [f"worker {index}: {reply}" for index, reply in zip(others, replies, strict=True) if reply]

    async def state_of_another(self) -> dict | None:
        """What control calls made of the workers, from the first other worker that answers (None if none does):
        for a worker started again in place of one that exited."""
        for index in range(len(self.sockets)):
            if index != self.own:
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    peer = await self._peer(index)
                    return await asyncio.wait_for(peer.exchange({"kind": "state"}), CONTROL_TIMEOUT_S)
        return None

    async def _control(self, index: int, action: str, arguments: dict) -> str:
        try:
            peer = await self._peer(index)
            reply = await asyncio.wait_for(peer.exchange({"kind": "control", "action": action, **arguments}),
                                           CONTROL_TIMEOUT_S)  # fmt: skip
        except (OSError, asyncio.TimeoutError) as error:
            return f"not reached ({type(error).__name__}: it is restarting, and takes the others' state when it is up)"
        return reply["error"] or ""

    async def _peer(self, home: int) -> FramedConnection:
        peer = self._peers.get(home)
        if peer is None or peer.closed:
            loop = asyncio.get_running_loop()
            _, peer = await loop.create_unix_connection(FramedConnection, self.sockets[home])
            self._peers[home] = peer
        return peer

    def close(self) -> None:
        for peer in self._peers.values():
            peer.close()
        self._peers.clear()


class FramedConnection(asyncio.Protocol):
    """One connection between two workers: pickled messages, each framed by its length and numbered, so that
    exchanges interleave (a protocol rather than asyncio's streams: half the round trip's time, measured)."""

    def __init__(self, on_message: Callable[[FramedConnection, int, dict], None] | None = None):
        self._on_message = on_message  # where messages are requests to answer (the home's side)
        self._buffer = bytearray()
        self._pending: dict[int, asyncio.Future] = {}  # the exchanges under way (the forwarding side's)
        self._numbers = itertools.count()
        self._transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self._transport = transport

    def connection_lost(self, error) -> None:
        self.closed = True
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ConnectionResetError("the other worker closed the connection"))
        self._pending.clear()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while len(self._buffer) >= _HEADER.size:
            number, length = _HEADER.unpack_from(self._buffer)
            end = _HEADER.size + length
            if len(self._buffer) < end:
                return
            message = pickle.loads(bytes(self._buffer[_HEADER.size : end]))
            del self._buffer[:end]
            if self._on_message is not None:
                self._on_message(self, number, message)
            elif (future := self._pending.pop(number, None)) is not None and not future.done():
                future.set_result(message)

    def send(self, number: int, message: dict) -> None:
        data = pickle.dumps(message, protocol=5)
        self._transport.write(_HEADER.pack(number, len(data)) + data)

    def exchange(self, message: dict) -> asyncio.Future:
        """``message`` sent now, and the future of the reply to it (sent here, not in a coroutine that a task would
        start on the loop's next turn)."""
        number = next(self._numbers)
        future = asyncio.get_running_loop().create_future()
        self._pending[number] = future
        future.add_done_callback(lambda _: self._pending.pop(number, None))  # answered, cancelled or timed out
        self.send(number, message)
        return future

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()


async def serve_forwarded(dataplane: DataPlane, path: str) -> asyncio.AbstractServer:
    """The Unix socket at ``path`` on which this worker answers the steps other workers forward to it, each as a
    call of its own, concurrently."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # left by this worker's previous process
    loop = asyncio.get_running_loop()
    answering: set[asyncio.Task] = set()

    def on_message(connection: FramedConnection, number: int, sent: dict) -> None:
        task = loop.create_task(_reply(dataplane, connection, number, sent))
        answering.add(task)  # held until done: a task only the loop references may be collected
        task.add_done_callback(answering.discard)

    server = await loop.create_unix_server(lambda: FramedConnection(on_message), path)
    os.chmod(path, 0o600)
    return server


async def _reply(dataplane: DataPlane, connection: FramedConnection, number: int, sent: dict) -> None:
    kind = sent["kind"]
    if kind == "infer":
        reply = await _answer(dataplane, sent)
    elif kind == "control":
        reply = await _controlled(dataplane, sent)
    else:  # "state"
        reply = dataplane.control_state()
    if not connection.closed:
        connection.send(number, reply)


async def _controlled(dataplane: DataPlane, sent: dict) -> dict:
    """A control call another worker took, made here too; the refusal's message where it failed."""
    action = sent["action"]
    try:
        if action == "load":
            await dataplane.load_model(sent["name"], sent["parameters"], here_only=True)
        elif action == "unload":
            await dataplane.unload_model(sent["name"], here_only=True)
        elif action == "register":
            arguments = [sent[key] for key in ("peer", "owner", "name", "key", "offset", "byte_size")]
            dataplane.shared_memory.register(*arguments)
        elif action == "unregister":
            dataplane.shared_memory.unregister(sent["peer"], sent["owner"], sent["name"])
        elif action == "logging":
            await dataplane.log_settings(sent["changes"], here_only=True)
    except RequestError as error:
        return {"error": error.message}
    return {"error": None}


async def _answer(dataplane: DataPlane, sent: dict) -> dict:
    """A forwarded request run here as a call of its own; its outputs, or why it was refused."""
    request: InferenceRequest = sent["request"]
    try:
        async with dataplane.inference(
            sent["protocol"], sent["timeout_s"], sent["method"], None, sent["peer"], sent["caller"]
        ) as call:
            response = await call.infer(request)
            with call.encoding():  # pickled as it is sent: the answer leaves the budget then
                pass
        return {"error": None, "signature": response.model, "outputs": response.outputs}
    except RequestError as error:
        return {"error": (error.kind.name, error.message, error.retry_after_s)}


def _portable(request: InferenceRequest) -> InferenceRequest:
    """The request with its parameters as plain dicts (a read-only mapping does not pickle)."""
    outputs = tuple(RequestedOutput(o.name, dict(o.parameters)) for o in request.outputs)
    return dataclasses.replace(request, parameters=dict(request.parameters), outputs=outputs)


def socket_paths(folder: Path, count: int) -> list[str]:
    return [str(folder / f"worker-{index}.sock") for index in range(count)]
