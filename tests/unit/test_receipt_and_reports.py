"""Small pieces at the transports' and the load test's edges, each alone: the stream slots (how many inference
streams one client may hold) and reads (how many read at once), a folder taken for a repository, and a load test's
verdict per SLO."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from mhaserve.contract.repository import ModelRepository
from mhaserve.loadtest.loadgen import Point, PointResult, Workload
from mhaserve.loadtest.slo import parse_slo, summary, summary_lines
from mhaserve.server.grpc.receipt import (
    AlreadyAnswered,
    ReceivingTurns,
    RequestReader,
    StreamEnded,
    StreamSlots,
)


def test_one_client_holds_its_share_of_the_streams_and_the_rest_stay_open_to_others():
    slots = StreamSlots(limit=4, per_client=2)
    with slots.held("a"), slots.held("a"):
        assert "its share (--max-inference-streams-per-client)" in slots.refusal("a")
        assert slots.refusal("b") is None
        with slots.held("b"), slots.held("c"):
            assert "--max-inference-streams is 4" in slots.refusal("d")
        assert slots.refusal("d") is None
    assert slots.open == 0 and slots.refusal("a") is None


def test_a_per_client_share_above_the_limit_is_the_limit():
    assert StreamSlots(limit=3, per_client=16).per_client == 3


def test_a_folder_taken_for_a_repository_is_named_for_what_it_is(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "manifest.json").write_text("{}")
    assert "is a model folder" in ModelRepository(tmp_path / "model").misplaced()
    (tmp_path / "versions" / "2").mkdir(parents=True)
    (tmp_path / "versions" / "2" / "manifest.json").write_text("{}")
    assert "holds version folders (2): it is one model's folder" in ModelRepository(tmp_path / "versions").misplaced()
    (tmp_path / "repository" / "mha" / "1").mkdir(parents=True)
    assert ModelRepository(tmp_path / "repository").misplaced() is None
    assert ModelRepository(tmp_path / "absent").misplaced() is None


def result(concurrency: int, throughput: float, p99_ms: float) -> PointResult:
    latencies = {"p50": p99_ms / 2, "p90": p99_ms, "p95": p99_ms, "p99": p99_ms, "p99.9": p99_ms, "max": p99_ms,
                 "mean": p99_ms / 2}  # fmt: skip
    return PointResult(Point("closed", concurrency, 1.0, 0.0), Workload(64, 1, 16, 16), 1, int(throughput),
                       throughput, latencies, {}, {}, 0.1, False, 0.0, 0, np.full(3, p99_ms))  # fmt: skip


def test_each_slo_passes_only_if_it_held_at_every_point_and_names_its_worst():
    results = [result(1, 900.0, 3.0), result(16, 1800.0, 17.0), result(64, 1700.0, 70.0)]
    slos = [parse_slo("p99<20ms"), parse_slo("throughput>1000")]
    p99, throughput = summary(results, slos)
    assert (p99["passed"], p99["worst"], p99["at"]) == (False, "70.000 ms", "concurrency 64")
    assert (throughput["passed"], throughput["worst"], throughput["at"]) == (False, "900.0/s", "concurrency 1")
    assert summary_lines(summary(results[1:2], slos)) == [
        "PASS  p99<20ms  (worst: 17.000 ms at concurrency 16)",
        "PASS  throughput>1000  (worst: 1800.0/s at concurrency 16)",
        "PASS: 2 of 2 SLOs held",
    ]


class Context:
    """A stream's call as the turns see it: a read that ends when its request is sent or the call is aborted."""

    def __init__(self, connection: str = "ipv4:127.0.0.1:1"):
        self.refusal = None
        self.connection = connection
        self._read = asyncio.get_running_loop().create_future()

    def peer(self) -> str:
        return self.connection

    def send(self) -> None:
        self._read.set_result(b"request")

    async def read(self) -> bytes:
        return await self._read

    async def abort(self, code, details="", trailing_metadata=()):  # grpc.aio's signature
        self.refusal = (code, details)
        self._read.set_exception(RuntimeError("the call was aborted"))  # as grpc.aio ends a pending read
        raise RuntimeError("aborted")  # and the handler that aborts


def test_streams_take_receiving_turns_in_the_order_they_asked_and_a_stream_gone_passes_its_turn_on():
    async def scenario():
        turns, order = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=60), []
        assert turns.count == 1

        async def stream(name: str, context: Context):
            async with turns.for_stream(name, context):
                order.append(name)
                await context.read()

        first, second, third = Context(), Context(), Context()
        a = asyncio.create_task(stream("a", first))
        await asyncio.sleep(0)
        b = asyncio.create_task(stream("b", second))
        c = asyncio.create_task(stream("c", third))
        await asyncio.sleep(0.01)
        assert order == ["a"] and not turns.take()  # one reads; the others wait unread, a unary read is refused
        b.cancel()  # gone while waiting: it takes no turn
        first.send()
        third.send()
        await asyncio.gather(a, c)
        assert order == ["a", "c"] and turns.free == 1  # every turn given back

    asyncio.run(scenario())


def test_clients_take_the_receiving_turn_in_rotation_so_one_clients_many_streams_wait_between_anothers():
    async def scenario():
        turns, order = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=60), []

        async def stream(client: str, name: str, context: Context):
            async with turns.for_stream(f"ipv4:127.0.0.1:{len(order)}", context, client):
                order.append(name)
                await context.read()

        contexts = {name: Context() for name in ("a1", "a2", "a3", "a4", "b1", "b2")}
        tasks = []
        for name in ("a1", "a2", "a3", "a4", "b1", "b2"):  # alice's four streams ask first, then bob's two
            tasks.append(asyncio.create_task(stream(name[0], name, contexts[name])))
            await asyncio.sleep(0)
        for _ in range(len(contexts)):
            await asyncio.sleep(0.01)
            contexts[order[-1]].send()
        await asyncio.gather(*tasks)
        assert order == ["a1", "b1", "a2", "b2", "a3", "a4"]  # the client served least recently first

    asyncio.run(scenario())


def test_a_stream_idle_in_its_turn_gives_way_to_a_waiting_stream_and_its_connection_waits_behind_others():
    async def scenario():
        turns, order, loop = (
            ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=0.3),
            [],
            asyncio.get_running_loop(),
        )
        idle_call, busy_call, turned = Context(), Context(), {}

        async def stream(connection: str, context: Context):
            async with turns.for_stream(connection, context):
                order.append(connection)
                turned[connection] = loop.time()
                await context.read()

        idle = asyncio.create_task(stream("idle", idle_call))  # never sent: holds its turn
        await asyncio.sleep(0.01)
        started = loop.time()
        waiting = asyncio.create_task(stream("busy", busy_call))
        await asyncio.sleep(0.35)
        assert order == ["idle", "busy"]  # handed the turn once the idle one had held it 300 ms
        assert 0.25 < turned["busy"] - started < 0.34
        with pytest.raises(StreamEnded):
            await idle
        code, details = idle_call.refusal
        assert code == grpc.StatusCode.UNAVAILABLE and "--stream-read-hold-s" in details
        # The idle stream's connection, reopened, waits behind a stream of another connection that came later.
        again = asyncio.create_task(stream("idle", Context()))
        await asyncio.sleep(0)
        later = asyncio.create_task(stream("other", Context()))
        await asyncio.sleep(0)
        busy_call.send()
        await waiting
        await asyncio.sleep(0.01)
        assert order[2:] == ["other"]
        for task in (again, later):
            task.cancel()
        await asyncio.gather(again, later, return_exceptions=True)
        assert turns.free == 1

    asyncio.run(scenario())


def test_a_unary_request_still_arriving_takes_the_turn_of_a_stream_idle_in_it():
    async def scenario():
        # hold_s well above the first wait: a loaded machine (the suite runs three workers on two cores) has delayed
        # a 10 ms sleep past 50 ms
        turns = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=0.3)
        idle_call = Context()
        idle = asyncio.create_task(_read_in_turn(turns, idle_call))
        await asyncio.sleep(0.01)
        assert not turns.take()  # held 10 ms: not yet idle long enough
        await asyncio.sleep(0.35)
        assert turns.take()
        with pytest.raises(StreamEnded):
            await idle
        assert idle_call.refusal[0] == grpc.StatusCode.UNAVAILABLE
        turns.give_back()
        assert turns.free == 1

    asyncio.run(scenario())


async def _read_in_turn(turns, context):
    async with turns.for_stream("idle", context):
        await context.read()


async def holding_the_turn(reader: RequestReader, connection: str) -> tuple[Context, asyncio.Task]:
    """A read on ``connection`` whose request is not sent (``send()`` sends it), once it holds the only turn past its
    first read: its call's context and the read."""
    call = Context(connection)
    read = asyncio.create_task(reader.read(call))
    while reader.turns.free:
        await asyncio.sleep(0.005)
    return call, read


async def waiting_for_the_held_turn(first_read_s: float, held_after: float, waits_after: float):
    """Two large requests on two connections, one turn: the first read ``held_after`` s ago, past its first read, so
    it holds the turn; the second read ``waits_after`` s ago, past its busy first read (10 ms), so it waits in line
    for the turn. Returns the reader, both calls' contexts and both reads (tasks)."""
    turns = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=60)
    reader = RequestReader(turns, receive_limit=1, timeout_s=5, first_read_s=first_read_s)
    holder, waiter = Context("ipv4:127.0.0.1:1"), Context("ipv4:127.0.0.1:2")
    first = asyncio.create_task(reader.read(holder))
    await asyncio.sleep(held_after)
    assert turns.free == 0
    second = asyncio.create_task(reader.read(waiter))
    await asyncio.sleep(waits_after)
    return reader, (holder, waiter), (first, second)


def test_a_request_arriving_while_the_first_read_is_taken_reads_in_a_free_turn_unless_its_connection_is_suspect():
    async def scenario():
        turns = ReceivingTurns(receiving_bytes=6, receive_limit=1, hold_s=60)
        assert turns.count == 2
        reader = RequestReader(turns, receive_limit=1, timeout_s=1.0, first_read_s=1.0)
        stalled = asyncio.create_task(reader.read(Context("ipv4:127.0.0.1:1")))  # holds the one first read 1 s
        await asyncio.sleep(0.01)
        loop = asyncio.get_running_loop()
        started, sent = loop.time(), Context("ipv4:127.0.0.1:2")
        sent.send()
        assert await reader.read(sent) == b"request"
        assert loop.time() - started < 0.5 and turns.free == 2  # not behind the stalled read; its turn given back
        turns.bad_standing.add("ipv4:127.0.0.1:3")
        suspect = Context("ipv4:127.0.0.1:3")
        suspect.send()
        waiting = asyncio.create_task(reader.read(suspect))
        await asyncio.sleep(0.05)
        assert not waiting.done() and turns.free == 2  # in bad standing: it waits for the first read
        never_sent = Context("ipv4:127.0.0.1:4")
        with pytest.raises(AlreadyAnswered):  # a read in a turn keeps the read timeout
            await reader.read(never_sent)
        assert never_sent.refusal[0] == grpc.StatusCode.DEADLINE_EXCEEDED
        assert await waiting == b"request"
        stalled.cancel()
        await asyncio.gather(stalled, return_exceptions=True)
        assert turns.free == 2

    asyncio.run(scenario())


def test_a_request_still_arriving_waits_briefly_for_the_turn_another_request_holds_and_is_read_not_refused():
    """Two large requests arriving at once on a loaded machine: the second's first read ends while the first holds
    the only turn; it waits for that turn in its first read and takes it once given back."""

    async def scenario():
        reader, (holder, second), (first, waiting) = await waiting_for_the_held_turn(
            0.05, held_after=0.08, waits_after=0.03
        )
        holder.send()
        second_request = asyncio.get_running_loop().call_later(0.01, second.send)
        assert await first == b"request" and await waiting == b"request"
        second_request.cancel()
        assert second.refusal is None and reader.turns.free == 1

    asyncio.run(scenario())


def test_one_callers_large_requests_wait_for_each_others_turns_however_busy_the_host_and_none_is_refused():
    """One caller sends large requests at once on a busy host, its connection not yet proven (none has arrived
    whole): the one holding the only turn takes far longer than a first read, and than the hold, to arrive. The
    others wait for it, not refused, and its own connection's read is not taken back for them."""

    async def scenario():
        turns = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=0.1)
        reader = RequestReader(turns, receive_limit=1, timeout_s=10, first_read_s=0.02)
        caller = "ipv4:127.0.0.1:1"
        holder, first = await holding_the_turn(reader, caller)
        others = [Context(caller) for _ in range(3)]
        reads = [asyncio.create_task(reader.read(call)) for call in others]
        await asyncio.sleep(0.5)  # 25 waits in line, 5 holds
        assert not any(read.done() for read in reads) and holder.refusal is None
        for call in (holder, *others):
            call.send()
        assert await first == b"request" and await asyncio.gather(*reads) == [b"request"] * 3
        assert all(call.refusal is None for call in others) and turns.free == 1

    asyncio.run(scenario())


def test_a_request_behind_another_connections_turn_is_refused_after_a_hold_and_its_connection_queues_behind():
    """A new caller's request that does not arrive while another connection holds the only turn waits a turn's
    hold (a request that arrives at all arrives meanwhile), then is refused; its connection, in bad standing, is
    refused after its first read until a request of its arrives whole."""

    async def scenario():
        turns = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=0.6)
        # Waits (0.3 s) far longer than a busy first read (BUSY_FIRST_READ_S), so that a loaded machine's delays
        # cannot make one look like the other.
        reader = RequestReader(turns, receive_limit=1, timeout_s=5, first_read_s=0.3)
        stalled, slow = "ipv4:127.0.0.1:1", "ipv4:127.0.0.1:2"
        _, holder = await holding_the_turn(reader, stalled)
        loop = asyncio.get_running_loop()
        started, refused = loop.time(), Context(slow)
        with pytest.raises(AlreadyAnswered):
            await reader.read(refused)
        code, details = refused.refusal
        assert (
            code == grpc.StatusCode.RESOURCE_EXHAUSTED
            and "stayed taken (they were other connections'); retry" in details
        )
        assert 0.6 < loop.time() - started < 1.5  # its busy first read (10 ms), then waits of 0.3 s past the hold
        assert slow in turns.bad_standing
        started, again = loop.time(), Context(slow)
        with pytest.raises(AlreadyAnswered):  # in bad standing: refused after its first read, not lined up
            await reader.read(again)
        assert loop.time() - started < 0.25
        sent = Context(slow)
        sent.send()
        assert await reader.read(sent) == b"request" and slow not in turns.bad_standing
        holder.cancel()
        await asyncio.gather(holder, return_exceptions=True)

    asyncio.run(scenario())


def test_one_callers_wait_for_its_own_turn_ends_once_another_connections_call_waits_for_the_read_it_holds():
    """A connection's calls wait for each other's turns while no other connection's call waits for the first read
    the waiting one holds; once one does, the wait is refused (retry) and that call read."""

    async def scenario():
        turns = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=60)
        reader = RequestReader(turns, receive_limit=1, timeout_s=5, first_read_s=0.3)
        caller, other = "ipv4:127.0.0.1:1", "ipv4:127.0.0.1:2"
        holder, first = await holding_the_turn(reader, caller)
        waiter = Context(caller)
        waiting = asyncio.create_task(reader.read(waiter))
        await asyncio.sleep(1.0)  # three waits in line, no other connection's call behind it
        assert not waiting.done()
        loop = asyncio.get_running_loop()
        started, sent = loop.time(), Context(other)
        sent.send()
        behind = asyncio.create_task(reader.read(sent))
        with pytest.raises(AlreadyAnswered):
            await waiting
        assert loop.time() - started < 1.0  # within a wait of 0.3 s
        code, details = waiter.refusal
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "another connection's call waited" in details
        assert await behind == b"request"
        holder.send()
        assert await first == b"request"

    asyncio.run(scenario())


def test_a_request_waiting_for_a_turn_on_a_starved_loop_is_given_the_turn_on_its_way_back_not_refused():
    """The loop blocked past a waiting request's time (a loaded machine, not a slow sender), the request holding the
    only turn arriving just after: the turn comes back and the waiting request is read, not refused."""

    async def scenario():
        reader, (holder, waiter), (first, second) = await waiting_for_the_held_turn(
            0.02, held_after=0.05, waits_after=0.015
        )
        time.sleep(0.06)  # the loop starved three times the wait's 20 ms
        loop = asyncio.get_running_loop()
        arrivals = [loop.call_later(0.005, holder.send), loop.call_later(0.01, waiter.send)]
        assert await first == b"request" and await second == b"request"
        for arrival in arrivals:
            arrival.cancel()
        assert waiter.refusal is None and reader.turns.free == 1

    asyncio.run(scenario())


async def proven(reader: RequestReader, connection: str) -> None:
    """A request read whole on ``connection``: an honest caller's connection from then on."""
    sent = Context(connection)
    sent.send()
    assert await reader.read(sent) == b"request"


def test_an_honest_callers_request_waits_for_the_turn_another_holds_however_busy_the_server_and_is_never_refused():
    """The server so busy that a request holding the only turn takes far longer than a first read to arrive: another
    request from a connection that has delivered requests waits for the turn, and is read, not refused."""

    async def scenario():
        turns = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=5)
        reader = RequestReader(turns, receive_limit=1, timeout_s=10, first_read_s=0.02)
        await proven(reader, "ipv4:127.0.0.1:2")
        holder, first = await holding_the_turn(reader, "ipv4:127.0.0.1:1")
        waiter = Context("ipv4:127.0.0.1:2")
        second = asyncio.create_task(reader.read(waiter))
        await asyncio.sleep(0.3)  # fifteen first reads, the holder still arriving
        assert not second.done()
        holder.send()
        waiter.send()
        assert await first == b"request" and await second == b"request"
        assert waiter.refusal is None and holder.refusal is None and turns.free == 1

    asyncio.run(scenario())


def test_a_turn_held_past_the_hold_while_an_honest_caller_waits_is_the_slow_senders_and_costs_only_its_call():
    async def scenario():
        turns = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=0.3)
        reader = RequestReader(turns, receive_limit=1, timeout_s=10, first_read_s=0.02)
        stalled, honest = "ipv4:127.0.0.1:1", "ipv4:127.0.0.1:2"
        await proven(reader, honest)
        holder, first = await holding_the_turn(reader, stalled)
        loop = asyncio.get_running_loop()
        started, waiter = loop.time(), Context(honest)
        second = asyncio.create_task(reader.read(waiter))
        while holder.refusal is None and loop.time() - started < 5:
            await asyncio.sleep(0.005)
        assert loop.time() - started < 1.0  # the hold (0.3 s) and a first read or two
        with pytest.raises(AlreadyAnswered):
            await first
        assert not second.done() and turns.free == 0  # the turn handed to the waiting request
        waiter.send()
        assert await second == b"request" and waiter.refusal is None
        code, details = holder.refusal
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "refused as a slow sender" in details
        assert stalled in turns.bad_standing and stalled not in reader.proven and turns.free == 1

    asyncio.run(scenario())


def test_a_stream_waiting_behind_a_stalled_unary_request_takes_its_turn_after_the_hold_but_not_an_honest_ones():
    async def scenario():
        turns = ReceivingTurns(receiving_bytes=3, receive_limit=1, hold_s=0.2)
        reader = RequestReader(turns, receive_limit=1, timeout_s=30, first_read_s=0.02)
        loop = asyncio.get_running_loop()
        stalled, unary = await holding_the_turn(reader, "ipv4:127.0.0.1:1")
        started, stream_call = loop.time(), Context("ipv4:127.0.0.1:9")
        stream = asyncio.create_task(_read_in_turn(turns, stream_call))
        while stalled.refusal is None and loop.time() - started < 5:
            await asyncio.sleep(0.005)
        assert loop.time() - started < 1.0  # the hold, not the read timeout (30 s)
        assert stalled.refusal[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "slow sender" in stalled.refusal[1]
        with pytest.raises(AlreadyAnswered):
            await unary
        stream_call.send()
        await stream
        # an honest caller's request (its connection proven) holding the turn is not taken back for a stream
        await proven(reader, "ipv4:127.0.0.1:2")
        honest, large = await holding_the_turn(reader, "ipv4:127.0.0.1:2")
        other_stream = Context("ipv4:127.0.0.1:9")
        waiting = asyncio.create_task(_read_in_turn(turns, other_stream))
        await asyncio.sleep(0.5)
        assert honest.refusal is None and not waiting.done()
        honest.send()
        assert await large == b"request"
        other_stream.send()
        await waiting
        assert turns.free == 1

    asyncio.run(scenario())
