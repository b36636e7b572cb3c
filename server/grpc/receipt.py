"""gRPC receipt: when a call's request is read, and what refuses it while it is still arriving.

grpcio's core receives a message whole once its read is asked for, before any handler can count or refuse it, so the
server asks for reads itself (the unary handlers are request-streaming on the server's side, the wire the same):
RequestReader gives each unary request a short first read, one at a time and fairly across connections (FirstReads), or
at once a free receiving turn while the first read is taken, then a receiving turn or a refusal; a ModelStreamInfer
stream reads its next request in a receiving turn of the same pool (ReceivingTurns), waiting in line for one;
StreamSlots bounds the streams open at once, in all and per client.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ..errors import ErrorKind, RequestError

# The data plane's refusals as gRPC statuses (the kinds are named after them).
GRPC_STATUS = {kind: grpc.StatusCode[kind.name] for kind in ErrorKind}


async def abort_refused(context, refusal: RequestError) -> None:
    """End the call with the refusal's status and message, and where it says when to retry, gRPC's retry pushback
    (honoured by gRPC's own retries and by mhaserve's client)."""
    trailers = ()
    if refusal.retry_after_s is not None:
        trailers = (("grpc-retry-pushback-ms", str(round(refusal.retry_after_s * 1000))),)
    await context.abort(GRPC_STATUS[refusal.kind], refusal.message, trailers)


# Requests in their first read at once (RequestReader). On loopback a whole message arrives within a first read, so
# each one at once may add a message to what receipt holds; one, fairly shared (FirstReads), keeps small requests
# unheld behind 16 stalled senders (BENCHMARKS.md, "Hostile clients").
FIRST_READS_AT_ONCE = 1
# A first read's time while every receiving turn is taken: a request already sent within the stream's window is
# read in well under it.
BUSY_FIRST_READ_S = 0.010
# The flow-control window of a stream (not grown: BDP probing off), all that a request not yet read may hold of the
# server: 256 KiB of tensor and 4 KiB for the rest of its message (names, shapes, parameters), so that a [1,128,512]
# query, 62 bytes past 256 KiB with its envelope, arrives whole rather than waiting for a window update
# (measured when it was chosen: a window update cost a round trip).
STREAM_WINDOW_BYTES = (256 + 4) << 10
# What a request of n bytes takes while grpcio receives it: n in its core's buffers, then a bytearray it copies
# them into and the bytes it makes of that.
GRPCIO_RECEIPT_COPIES = 3
# Why a read of a connection not proven, waiting for a turn, is refused once another connection's call wants its read.
ANOTHER_CONNECTION_WAITS = "another connection's call waited for the read it held"


class RequestReader:
    """Reads a call's request when its handler asks: small ones at once, large or slow ones a few at a time.

    A request not yet read waits in its stream's flow-control window (STREAM_WINDOW_BYTES, not grown) while its
    sender is held back; once a read is asked for, gRPC's core receives the whole message, up to the receive limit. So a
    read first runs for ``first_read_s`` without a turn: a request within the window, or one that arrives that fast, is
    read then, whatever other senders do or fail to do. At most ``first_reads`` run at once, one per connection, the
    calls of connections in good standing first (FirstReads); while they are taken, a call from a connection in good
    standing reads at once in a free receiving turn (one of the turns below, so the bound is the same); the others wait
    unread, so what first reads take is bounded, and stalled senders queue behind themselves. A request still arriving
    after its first read needs one of the receiving turns (each reserves three times the receive limit in
    --max-receiving-bytes). With none free, it waits for one in its first read (what it takes is the first read's,
    bounded) where its connection is proven (one that delivered a request whole since its last refusal: an honest
    caller's), and a turn another read has held ``turns.hold_s`` with its request not arrived is taken back for it,
    that read refused as the slow sender (Kestrel's grace for slow bodies, costing the slow sender; one of its own
    connection's only once another connection's call waits for the first read it holds). A call of a connection not
    proven waits while no other connection's call waits for the first read it holds (once one does, it is refused
    RESOURCE_EXHAUSTED at once: FirstReads tells ``_another_waits``): in line for a turn where its connection's calls
    wait for each other (one of them holds a turn or waits for the first read: one caller's large requests at once
    on a busy host), else out of line, up to ``turns.hold_s`` (its bytes arrive meanwhile, its read being under
    way, so a new caller is read, not refused for a stalled sender holding the turns, and takes no turn a stream
    waits for); then it is refused (retry). A call of a connection in bad standing is refused at once (its bytes
    would go on arriving while it waited). One that has not arrived ``timeout_s`` after its read began is refused
    DEADLINE_EXCEEDED. A refused call puts its connection in bad standing; a request read whole restores it. A
    stalled sender can hold a turn until a proven caller's read or a stream wants it for ``turns.hold_s``, and the
    first read until another connection's call wants it, ``turns.hold_s`` at most on its connection's first call
    (longer only while its own connection's calls wait behind it)."""

    def __init__(
        self,
        turns: ReceivingTurns,
        receive_limit: int,
        timeout_s: float,
        first_read_s: float,
        first_reads: int = FIRST_READS_AT_ONCE,
        abandoned: Callable[[int], None] = lambda nbytes: None,
    ):
        self.turns = turns
        self._timeout_s = timeout_s
        self._first_read_s = min(first_read_s, timeout_s)
        self._first_reads = FirstReads(first_reads, turns.bad_standing, self._another_waits)
        self._abandoned = abandoned  # told of a read refused part-way: grpcio may have taken up to the limit for it
        self._receive_limit = receive_limit
        # The reads whose time is running (their first read's, then their wait's for a turn), each with when it is
        # up, how long it was, what decides then and whether it was given its time once more, and the one timer
        # that watches them all, armed for the earliest (a timer armed and cancelled for every read cost the event
        # loop 13 us a request, measured when it was chosen).
        self._timed: dict[_Read, tuple[float, float, Callable[[_Read], None], bool]] = {}
        self._watch: asyncio.TimerHandle | None = None
        # Connections that delivered a request whole since their last refusal: an honest caller's, whose request
        # that waits for a turn is not refused for the server's own slowness, but waits for it.
        self.proven = RecentConnections()

    async def read(self, context) -> bytes:
        connection = context.peer()
        reading = _Read(context, connection)
        if not self._first_reads.take_now(connection):
            # Every first read is taken: a connection in good standing reads at once in a free receiving turn (what
            # receipt holds is bounded all the same) rather than waiting unread for a first read.
            if connection not in self.turns.bad_standing and self.turns.free:
                self.turns.take()
                reading.first = False
                self._hold(reading)
            else:
                await self._first_reads.acquire(connection)
        # Timers, not a task racing the read (a task per request cost throughput: BENCHMARKS.md, "Hostile clients"):
        # the read is awaited in the call's own task, and a timer that refuses it answers the call meanwhile.
        loop = asyncio.get_running_loop()
        # With every turn taken, a first read that goes long waits for a turn or is refused, and what arrives
        # meanwhile may be waste: it gets BUSY_FIRST_READ_S (on loopback a large message arrives whole within a
        # first read's usual time).
        first_read_s = self._first_read_s if self.turns.free else min(self._first_read_s, BUSY_FIRST_READ_S)
        reading.started = loop.time()
        # The read timeout is armed only for a read that outlasts its first read (_first_read_decided): a timer
        # per request would keep --grpc-read-timeout-s worth of requests' timers in the loop's heap.
        self._decide_after(reading, first_read_s, self._first_read_decided)
        try:
            raw = await context.read()
        except Exception:
            if reading.refusal is None:
                raise
            raw = None
        finally:
            reading.finished = True
            self._timed.pop(reading, None)
            if reading.timed_out is not None:
                reading.timed_out.cancel()
            if reading.withdraw is not None:  # still waiting for a turn
                reading.withdraw()
            if reading.first:
                self._first_reads.release(connection)
            if reading.turn:
                self.turns.release_unary(reading)
                self.turns.give_back()
        if reading.refusal is not None:  # answered by _refuse: once its status is sent, the handler ends
            await reading.answering
            raise AlreadyAnswered(reading.refusal)
        self.turns.bad_standing.discard(connection)
        self.proven.add(connection)
        if raw is grpc.aio.EOF:
            raise RequestError(ErrorKind.INVALID_ARGUMENT, "the call ended without a request message")
        return raw

    def _decide_after(self, reading: _Read, seconds: float, decide: Callable[[_Read], None]) -> None:
        """``decide(reading)`` once its ``seconds`` from now are up (its first read's, then its wait's for a turn),
        by the one timer that watches every read's time."""
        due = asyncio.get_running_loop().time() + seconds
        self._timed[reading] = (due, seconds, decide, False)
        if self._watch is None or due < self._watch.when():
            if self._watch is not None:
                self._watch.cancel()
            self._watch = asyncio.get_running_loop().call_at(due, self._times_up)

    def _times_up(self) -> None:
        """Each read whose time is up is decided a loop tick later, so that a read whose completion is already
        queued (a loaded loop runs its timers late) ends first. A time up later than its own length (a starved
        loop, not a slow sender) is given that time once more."""
        self._watch = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        for reading, (due, seconds, decide, rearmed) in list(self._timed.items()):
            if now < due:
                continue
            if now - due > seconds and not rearmed:
                self._timed[reading] = (now + seconds, seconds, decide, True)
                continue
            del self._timed[reading]
            loop.call_soon(decide, reading)
        if self._timed:
            self._watch = loop.call_at(min(due for due, *_ in self._timed.values()), self._times_up)

    def _first_read_decided(self, reading: _Read) -> None:
        """The request is still arriving: it takes a turn, waits in its first read for one, or is refused."""
        if reading.finished:
            return
        if reading.turn:  # it read in a turn from the start
            self._arm_read_timeout(reading)
        elif self.turns.take():
            self._turn_taken(reading)
        elif reading.connection in self.turns.bad_standing:
            # Its bytes would go on arriving while it waited: a stalled sender that reopens its call at once must not
            # hold a place in line by it.
            self._no_turn_came(reading, "its connection is in bad standing")
        else:
            reading.withdraw = self.turns.wait(lambda: self._turn_taken(reading), reading.connection in self.proven)
            # On a starved loop the turn may be on its way back, from a read whose completion is queued behind this.
            self._wait_for_turn(reading)

    def _wait_for_turn(self, reading: _Read) -> None:
        self._decide_after(reading, self._first_read_s, self._no_turn_decided)

    def _no_turn_decided(self, reading: _Read) -> None:
        if reading.finished or reading.turn or reading.refusal is not None:
            return
        waited_s = asyncio.get_running_loop().time() - reading.started
        if waited_s >= self._timeout_s:
            self._leave_first_read(reading)
            self._read_timed_out(reading)
            return
        connection = reading.connection
        others_wait = self._first_reads.others_waiting(connection)
        if connection in self.proven:
            # An honest caller's request is not refused for the turn another holds: it waits, and a holder that has
            # held its turn past the hold is the slow sender, refused instead (one of its own connection's only once
            # another connection's call waits for the read this one holds).
            self.turns.take_back_long_holds(1, unary="any", besides=None if others_wait else connection)
        elif others_wait:
            self._no_turn_came(reading, ANOTHER_CONNECTION_WAITS)
            return
        elif not (self.turns.holds_of(connection) or self._first_reads.own_waiting(connection)):
            # The turns are other connections'. Its bytes arrive meanwhile all the same (its read is under way,
            # bounded as the first read), so it waits out of line, taking no turn a stream or another read waits
            # for, as long as a turn's hold at most: a new caller's request is read, not refused for a stalled
            # sender holding the turns.
            if waited_s > self.turns.hold_s:
                self._no_turn_came(reading, "they were other connections'")
                return
            if reading.withdraw is not None:
                reading.withdraw()
                reading.withdraw = None
        # Else its connection's calls wait for each other (one caller's large requests at once on a busy host).
        self._wait_for_turn(reading)

    def _another_waits(self, connection: str) -> None:
        """A call of ``connection`` waits for a first read: a read holding one while it waits for a turn, of a
        connection neither proven nor ``connection``, is refused now rather than at its next decision, so that the
        call waiting is read at once."""
        for reading, (_, _, decide, _) in list(self._timed.items()):
            waiting_for_turn = decide == self._no_turn_decided
            if waiting_for_turn and reading.connection != connection and reading.connection not in self.proven:
                del self._timed[reading]
                self._no_turn_came(reading, ANOTHER_CONNECTION_WAITS)

    def _hold(self, reading: _Read) -> None:
        reading.turn = True
        proven = reading.connection in self.proven
        self.turns.hold_unary(reading, reading.connection, proven, lambda s: self._refuse_slow_sender(reading, s))

    def _refuse_slow_sender(self, reading: _Read, held_s: float) -> None:
        """Its turn taken back (ReceivingTurns.take_back_long_holds): the slow sender pays, not the call waiting."""
        self._abandoned(self._receive_limit)
        self._refuse(
            reading,
            RequestError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"the request had not arrived {held_s:.1f} s after it took a receiving turn, while another request "
                f"waited for the turn (--stream-read-hold-s {self.turns.hold_s:g}): refused as a slow sender; retry",
                shed_by="receiving",
            ),
        )

    def _turn_taken(self, reading: _Read) -> None:
        reading.withdraw = None
        self._timed.pop(reading, None)  # it waited for the turn: no refusal is due
        reading.first = False
        self._hold(reading)
        self._first_reads.release(reading.connection)
        self._arm_read_timeout(reading)

    def _arm_read_timeout(self, reading: _Read) -> None:
        loop = asyncio.get_running_loop()
        reading.timed_out = loop.call_at(reading.started + self._timeout_s, self._read_timed_out, reading)

    def _leave_first_read(self, reading: _Read) -> None:
        """A read about to be refused while it waits for a turn leaves the line and frees its first read at once."""
        if reading.withdraw is not None:
            reading.withdraw()
            reading.withdraw = None
        reading.first = False
        self._first_reads.release(reading.connection)
        self._abandoned(self._receive_limit)

    def _no_turn_came(self, reading: _Read, why: str) -> None:
        """Refuse a read that waited for a turn, saying ``why`` the turns stayed out of its reach."""
        self._leave_first_read(reading)
        waited_ms = (asyncio.get_running_loop().time() - reading.started) * 1000
        self._refuse(
            reading,
            RequestError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"the request had not arrived {waited_ms:.0f} ms after its read began (--grpc-first-read-ms), and "
                f"the {self.turns.count} turn(s) for requests still arriving (--max-receiving-bytes) stayed taken "
                f"({why}); retry",
                shed_by="receiving",
            ),
        )

    def _read_timed_out(self, reading: _Read) -> None:
        self._refuse(
            reading,
            RequestError(
                ErrorKind.DEADLINE_EXCEEDED,
                f"the request did not arrive within --grpc-read-timeout-s ({self._timeout_s:g} s)",
            ),
        )

    def _refuse(self, reading: _Read, refusal: RequestError) -> None:
        """Answer the call with ``refusal`` now, while its read is under way: the read then ends (its request is
        never taken whole) and the call's task goes on from it. (Cancelling the task's wait on the read instead
        left the message's bytes held for good, burst after burst: BENCHMARKS.md, "Hostile clients".)"""
        if reading.refusal is None:
            reading.refusal = refusal
            reading.answering = asyncio.ensure_future(_answer_with(reading.context, refusal))
            self.turns.bad_standing.add(reading.connection)
            self.proven.discard(reading.connection)


@dataclass(eq=False)
class _Read:
    """One call's read under way: its context, whether it holds its first read or a turn, and why it was refused."""

    context: object
    connection: str
    started: float = 0.0  # when its read began, on the loop's clock
    timed_out: asyncio.TimerHandle | None = None  # the read timeout, once the read outlasts its first read
    withdraw: Callable[[], None] | None = None  # while it waits for a turn: leaves the line
    finished: bool = False  # its read has ended
    first: bool = True
    turn: bool = False
    refusal: RequestError | None = None
    answering: asyncio.Future | None = None


class AlreadyAnswered(Exception):
    """The call was answered with its refusal while its request was still arriving."""

    def __init__(self, refusal: RequestError):
        super().__init__(refusal.message)
        self.refusal = refusal


async def _answer_with(context, refusal: RequestError) -> None:
    try:
        await abort_refused(context, refusal)
    except BaseException:  # grpc.aio raises to end the handler that aborts; this is not the handler
        pass


class RecentConnections:
    """A set of connections, the most recent REMEMBERED kept, the oldest forgotten first. Event loop only.

    Kept twice: those in bad standing (a call refused while its request arrived, a stalled sender, or a stream that
    held a receiving turn idle), whose reads wait behind those of connections in good standing, so that a stalled
    sender that reopens its call at once queues behind itself, not before other callers; and those proven (a
    request read whole since the last refusal: RequestReader.proven)."""

    REMEMBERED = 4096

    def __init__(self):
        self._connections: collections.OrderedDict[str, None] = collections.OrderedDict()

    def __contains__(self, connection: str) -> bool:
        return connection in self._connections

    def add(self, connection: str) -> None:
        self._connections[connection] = None
        self._connections.move_to_end(connection)
        while len(self._connections) > self.REMEMBERED:
            self._connections.popitem(last=False)

    def discard(self, connection: str) -> None:
        self._connections.pop(connection, None)


class FirstReads:
    """The first reads under way at once (RequestReader): at most ``limit``, one per connection, those of
    connections in good standing first; ``another_waits(connection)`` is told as a call of it starts waiting.
    Event loop only."""

    def __init__(
        self, limit: int, bad_standing: RecentConnections, another_waits: Callable[[str], None] = lambda c: None
    ):
        self._free = limit
        self._busy: set[str] = set()  # connections with a first read under way
        self._bad_standing = bad_standing
        self._another_waits = another_waits
        self._waiting: dict[bool, collections.deque] = {False: collections.deque(), True: collections.deque()}

    def take_now(self, connection: str) -> bool:
        """A first read for ``connection`` if one is free and no waiter it would pass is eligible for it."""
        suspect = connection in self._bad_standing
        ahead = (self._waiting[False], self._waiting[True]) if suspect else (self._waiting[False],)
        if self._free and connection not in self._busy and not self._eligible(ahead):
            self._take(connection)
            return True
        return False

    async def acquire(self, connection: str) -> None:
        if self.take_now(connection):
            return
        suspect = connection in self._bad_standing
        handed = asyncio.get_running_loop().create_future()
        entry = (connection, handed)
        self._waiting[suspect].append(entry)
        self._another_waits(connection)
        try:
            await handed
        except asyncio.CancelledError:
            if handed.done() and not handed.cancelled():  # handed a slot, then gone: pass it on
                self.release(connection)
            else:
                self._waiting[suspect].remove(entry)
            raise

    def others_waiting(self, connection: str) -> bool:
        """Whether a call of a connection other than ``connection`` waits for a first read."""
        return any(waiter != connection for queue in self._waiting.values() for waiter, _ in queue)

    def own_waiting(self, connection: str) -> bool:
        """Whether another call of ``connection`` waits for a first read."""
        return any(waiter == connection for queue in self._waiting.values() for waiter, _ in queue)

    def release(self, connection: str) -> None:
        self._free += 1
        self._busy.discard(connection)
        self._hand_on()

    def _eligible(self, queues) -> bool:
        """Whether any waiter in ``queues`` could take a free slot (its connection has no first read under way)."""
        return any(connection not in self._busy for queue in queues for connection, _ in queue)

    def _take(self, connection: str) -> None:
        self._free -= 1
        self._busy.add(connection)

    def _hand_on(self) -> None:
        """Free slots to the waiters first in line: those of connections in good standing, then the others."""
        for queue in (self._waiting[False], self._waiting[True]):
            for entry in list(queue):
                if not self._free:
                    return
                connection, handed = entry
                if connection in self._busy or handed.done():
                    continue
                queue.remove(entry)
                self._take(connection)
                handed.set_result(None)


class StreamIdle(Exception):
    """A stream's next request did not come within the idle timeout."""


class StreamEnded(Exception):
    """The stream was ended with a refusal (its turn held idle while others waited) while it was reading."""


class ReceivingTurns:
    """The receiving turns of --max-receiving-bytes, one per three messages of --max-message-bytes: what requests
    still arriving may hold at once. A unary request that outlasts its first read takes one, waits for one, or is
    refused (RequestReader), a proven connection's ahead of streams (its bytes are arriving, and it holds the first
    read), the others' behind streams of connections in good standing; a ModelStreamInfer stream reads its next
    request only in one, waiting in line for it, its sender held to the stream's window meanwhile. A stream
    waiting for a request its client has not sent cannot be told from one receiving it, so a stream that has held
    its turn ``hold_s`` without its request arriving while another request waits for one is ended UNAVAILABLE
    (reopen and send) and its turn handed on; its connection is then in bad standing, its streams behind those of
    other connections, so an idle or stalled stream delays another's read by ``hold_s`` at most, once. Event loop
    only."""

    def __init__(self, receiving_bytes: int, receive_limit: int, hold_s: float):
        self.count = max(1, receiving_bytes // (GRPCIO_RECEIPT_COPIES * receive_limit))
        self.free = self.count
        self._streams: dict[_StreamTurn, None] = {}  # streams holding a turn, the longest held first
        self._unary: dict[object, _UnaryHold] = {}  # unary reads holding a turn past their first read, the same
        # streams waiting for a turn: those of connections in good standing, then those that held one idle; each
        # line serves the client whose stream took a turn least recently first (a fair queue), so that one client's
        # many idle streams, or the one holding the turn now, delay another client's stream by one hold at most
        self._waiting: dict[bool, FairLine] = {False: FairLine(), True: FairLine()}
        self._served: dict[str, int] = {}  # client -> when a stream of its last took a turn, counted in turns
        self._turns_taken = itertools.count(1)
        # unary reads waiting for a turn, what each is told once it holds one: those of proven connections, the others
        self._unary_waiting: dict[bool, collections.deque[Callable[[], None]]] = {
            True: collections.deque(),
            False: collections.deque(),
        }
        self.bad_standing = RecentConnections()
        self.hold_s = hold_s
        self._timer: asyncio.TimerHandle | None = None

    def take(self) -> bool:
        """A turn for a unary request still arriving, now or never (its bytes would go on arriving while it
        waited); a stream holding one idle past ``hold_s`` gives way to it."""
        if not self.free:
            self.take_back_long_holds(1, unary="none")
        if not self.free:
            return False
        self.free -= 1
        return True

    def wait(self, handed: Callable[[], None], proven: bool) -> Callable[[], None]:
        """Line a unary request still arriving up for a turn given back (its connection ``proven``: ahead of streams,
        else behind those in good standing): ``handed`` is called once it holds one. Returns what takes it out of
        line."""
        line = self._unary_waiting[proven]
        line.append(handed)
        return lambda: line.remove(handed) if handed in line else None

    def give_back(self) -> None:
        self.free += 1
        self._hand_on()

    def hold_unary(self, key, connection: str, proven: bool, take_back: Callable[[float], None]) -> None:
        """A unary read on ``connection`` holds a turn past its first read; ``take_back(held_s)`` refuses it, should
        its turn be taken back (its connection ``proven``: taken back only for another proven caller's request)."""
        self._unary[key] = _UnaryHold(asyncio.get_running_loop().time(), connection, proven, take_back)
        self._arm()

    def holds_of(self, connection: str) -> bool:
        """Whether a unary read of ``connection`` holds a turn."""
        return any(hold.connection == connection for hold in self._unary.values())

    def release_unary(self, key) -> None:
        self._unary.pop(key, None)

    @contextlib.asynccontextmanager
    async def for_stream(self, connection: str, context, client: str = ""):
        """Hold a turn while a stream reads its next request: waits for one in line, its ``client`` (a caller the
        server tells apart, else its connection) served in the line after clients served less recently, and raises
        StreamEnded (its refusal already sent) once the stream was ended for holding it idle."""
        turn = _StreamTurn(context, connection, client or connection)
        suspect = connection in self.bad_standing
        ahead = (self._waiting[False], self._waiting[True]) if suspect else (self._waiting[False],)
        if self.free and not any(ahead):
            self.free -= 1
            self._hold(turn)
        else:
            turn.handed = asyncio.get_running_loop().create_future()
            self._waiting[suspect].append(turn)
            self._arm()
            try:
                await turn.handed
            except asyncio.CancelledError:
                if turn.handed.done() and not turn.handed.cancelled():  # handed a turn, then gone: pass it on
                    self._release(turn)
                elif turn in self._waiting[suspect]:  # else passed over already, being done
                    self._waiting[suspect].remove(turn)
                raise
        try:
            yield
        except Exception:
            if turn.ended is None:
                raise
        finally:
            self._release(turn)
        if turn.ended is not None:
            await turn.ended
            raise StreamEnded

    def _hold(self, turn: _StreamTurn) -> None:
        turn.since = asyncio.get_running_loop().time()
        self._streams[turn] = None
        self.bad_standing.discard(turn.connection)
        self._served[turn.client] = next(self._turns_taken)
        if len(self._served) > RecentConnections.REMEMBERED:  # forget clients with no stream waiting
            waiting = {client for line in self._waiting.values() for client in line.clients}
            self._served = {client: when for client, when in self._served.items() if client in waiting}

    def _release(self, turn: _StreamTurn) -> None:
        if turn in self._streams:  # an ended stream's turn was handed on when it was ended
            del self._streams[turn]
            self.give_back()

    def _hand_on(self) -> None:
        """Free turns to those waiting: proven connections' unary reads, streams of connections in good standing,
        other unary reads, then the streams that held a turn idle."""
        self._hand_unary(self._unary_waiting[True])
        self._hand_streams(self._waiting[False])
        self._hand_unary(self._unary_waiting[False])
        self._hand_streams(self._waiting[True])

    def _hand_unary(self, line: collections.deque[Callable[[], None]]) -> None:
        while line and self.free:
            self.free -= 1
            line.popleft()()

    def _hand_streams(self, line: FairLine) -> None:
        while line and self.free:
            turn = line.popleft(lambda client: self._served.get(client, 0))
            if turn.handed.done():
                continue
            self.free -= 1
            self._hold(turn)
            turn.handed.set_result(None)

    def _arm(self) -> None:
        """A timer for when the longest-held turn a waiting stream may take back reaches ``hold_s``."""
        if self._timer is not None or not any(self._waiting.values()):
            return
        holds = self._long_holds(unary="unproven", now=None)
        if holds:
            self._timer = asyncio.get_running_loop().call_at(holds[0][0] + self.hold_s, self._held_long)

    def _held_long(self) -> None:
        self._timer = None
        self.take_back_long_holds(sum(map(len, self._waiting.values())), unary="unproven")
        self._arm()

    def _long_holds(self, unary: str, now: float | None, besides: str | None = None) -> list[tuple[float, object]]:
        """(since, holder) of the turns held ``hold_s`` by ``now`` (None: every one), longest first: every stream's,
        and the unary reads' ``unary`` says ("none", "unproven": those of connections not proven, "any"), but for
        those of connection ``besides``."""
        holds = [(turn.since, turn) for turn in self._streams]
        if unary != "none":
            holds += [
                (hold.since, key)
                for key, hold in self._unary.items()
                if (unary == "any" or not hold.proven) and hold.connection != besides
            ]
        if now is not None:
            holds = [(since, holder) for since, holder in holds if now - since >= self.hold_s]
        return sorted(holds, key=lambda hold: hold[0])

    def take_back_long_holds(self, wanted: int, unary: str, besides: str | None = None) -> None:
        """Take back up to ``wanted`` turns held ``hold_s`` with no request arriving while others wait, longest
        first: a stream's is ended UNAVAILABLE and its turn handed on at once; a unary read's (``unary`` and
        ``besides``: which may be, as ``_long_holds``) is refused as a slow sender, its turn handed on as its read
        ends."""
        now = asyncio.get_running_loop().time()
        for since, holder in self._long_holds(unary, now, besides)[:wanted]:
            if isinstance(holder, _StreamTurn):
                self._end_stream(holder)
            else:
                self._unary.pop(holder).take_back(now - since)

    def _end_stream(self, turn: _StreamTurn) -> None:
        """A stream that held its turn idle is ended UNAVAILABLE, its connection's streams behind others', and its
        turn handed on."""
        del self._streams[turn]
        self.bad_standing.add(turn.connection)
        turn.ended = asyncio.ensure_future(
            _answer_with(
                turn.context,
                RequestError(
                    ErrorKind.UNAVAILABLE,
                    f"this stream held a receiving turn {self.hold_s:g} s with no request arriving while other "
                    f"requests waited for one (--stream-read-hold-s): ended; reopen it and send. The server has "
                    f"{self.count} turn(s), each three times --max-message-bytes of --max-receiving-bytes: a message "
                    "limit sized to the requests gives streams that pause a turn each",
                ),
            )
        )
        self.give_back()


@dataclass(eq=False)
class _UnaryHold:
    """A unary read in a turn past its first read: since when, whether its connection is proven, and what refuses
    it if its turn is taken back."""

    since: float
    connection: str
    proven: bool
    take_back: Callable[[float], None]


@dataclass(eq=False)
class _StreamTurn:
    """A stream's read in a turn, or waiting for one."""

    context: object
    connection: str
    client: str
    since: float = 0.0  # when it took its turn, on the loop's clock
    handed: asyncio.Future | None = None  # while it waits: set once a turn is its
    ended: asyncio.Future | None = None  # once ended for holding its turn idle: its refusal being sent


class FairLine:
    """Streams waiting for a turn, each client's own in the order they came, taken a client at a time in the order
    the turns give (``popleft``). Event loop only."""

    def __init__(self):
        self._clients: dict[str, collections.deque[_StreamTurn]] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, turn: _StreamTurn) -> bool:
        return turn in self._clients.get(turn.client, ())

    @property
    def clients(self):
        """The clients with a stream in this line."""
        return self._clients.keys()

    def append(self, turn: _StreamTurn) -> None:
        self._clients.setdefault(turn.client, collections.deque()).append(turn)
        self._count += 1

    def remove(self, turn: _StreamTurn) -> None:
        own = self._clients[turn.client]
        own.remove(turn)
        self._count -= 1
        if not own:
            del self._clients[turn.client]

    def popleft(self, served_when: Callable[[str], int]) -> _StreamTurn:
        """The first stream of the client ``served_when`` puts first (the one served least recently)."""
        client = min(self._clients, key=served_when)
        own = self._clients[client]
        turn = own.popleft()
        self._count -= 1
        if not own:
            del self._clients[client]
        return turn


class StreamSlots:
    """The ModelStreamInfer streams open at once: at most ``limit`` in all and ``per_client`` for one client (a
    caller the server tells apart, else a connection), so that one client's idle streams cannot lock every other
    client out of streaming."""

    def __init__(self, limit: int, per_client: int):
        self.limit, self.per_client = limit, min(per_client, limit)
        self.open = 0
        self._by_client: dict[str, int] = {}

    def refusal(self, client: str) -> str | None:
        if self.open >= self.limit:
            return f"too many inference streams open: --max-inference-streams is {self.limit}; retry once one ends"
        if self._by_client.get(client, 0) >= self.per_client:
            return (
                f"this client has {self.per_client} inference streams open, its share "
                "(--max-inference-streams-per-client); end one, or send on those it has"
            )
        return None

    @contextlib.contextmanager
    def held(self, client: str):
        self.open += 1
        self._by_client[client] = self._by_client.get(client, 0) + 1
        try:
            yield
        finally:
            self.open -= 1
            self._by_client[client] -= 1
            if not self._by_client[client]:
                del self._by_client[client]
