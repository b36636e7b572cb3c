"""The memory budget alone: what requests in flight hold (their bytes, what the runs that may happen at once
need, what sequences keep), refused over the limit with the figures, and given back."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mhaserve.contract.signature import ModelSignature
from mhaserve.server import accounting, memory
from mhaserve.server.accounting import Receipt, RequestAccounting
from mhaserve.server.batcher import QueueTimeout
from mhaserve.server.errors import ErrorKind, RequestError
from mhaserve.server.memory import InflightBytesExceeded, MemoryBudget
from mhaserve.server.metrics import Metrics
from mhaserve.server.tensors import RunInputs


def test_a_request_is_admitted_within_the_limit_and_refused_beyond_it_naming_the_figures():
    budget = MemoryBudget(limit=1000)
    token = budget.admit(request_bytes=300, rows=1, workspace=200)
    assert budget.held == 500
    with pytest.raises(InflightBytesExceeded) as refused:
        budget.admit(request_bytes=300, rows=1, workspace=500)  # 600 bytes + the larger run's 500: over
    assert refused.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert "needs 800 bytes" in refused.value.message and "hold 500" in refused.value.message
    assert "max_inflight_bytes=1000" in refused.value.message
    budget.run_ended(token)
    budget.release(300)
    assert budget.held == 0 and budget.idle


def test_the_workspace_counted_is_what_the_runs_that_may_happen_at_once_need():
    # Batching off, one worker: one request runs at a time, so only the largest waiting workspace counts.
    alone = MemoryBudget(limit=10_000, workers=1, max_batch_size=None)
    for workspace in (100, 400, 200):
        alone.admit(request_bytes=0, rows=1, workspace=workspace)
    assert alone.held == 400
    # Batching to 2 rows with two workers: at most 4 rows run at once, at the largest workspace per row.
    batched = MemoryBudget(limit=10_000, workers=2, max_batch_size=2)
    for _ in range(6):
        batched.admit(request_bytes=0, rows=1, workspace=100)
    assert batched.held == 400


def test_padded_runs_count_every_waiting_row_at_the_longest_row_s_workspace():
    padded = MemoryBudget(limit=10_000, workers=1, max_batch_size=8, padded_runs=True)
    padded.admit(request_bytes=0, rows=1, workspace=1000)  # a long request
    padded.admit(request_bytes=0, rows=3, workspace=30)  # three short rows, padded to the long one in its run
    assert padded.held == 4000
    unpadded = MemoryBudget(limit=10_000, workers=1, max_batch_size=8)
    unpadded.admit(request_bytes=0, rows=1, workspace=1000)
    unpadded.admit(request_bytes=0, rows=3, workspace=30)
    assert unpadded.held == 1030  # never more than the rows waiting need together


def test_the_arenas_keep_the_largest_runs_made_until_they_are_given_back():
    budget = MemoryBudget(limit=10_000, workers=2)
    for workspace in (100, 700, 300):
        budget.run_made(workspace)
    assert budget.kept_workspace == 1000 and budget.held == 1000 and budget.idle  # held, yet nothing in flight
    budget.workspace_given_back()
    assert budget.held == 0


def test_what_sequences_keep_counts_between_requests_and_is_let_go():
    budget = MemoryBudget(limit=1000)
    budget.keep(600, "a sequence's keys and values")
    assert budget.held == 600 and budget.idle  # kept state is no request in flight
    with pytest.raises(InflightBytesExceeded) as refused:
        budget.take(500, "the request as received")
    assert "(the request as received)" in refused.value.message
    budget.let_go(600)
    budget.take(500, "the request as received")
    assert budget.held == 500 and not budget.idle


def test_what_sequences_keep_together_stops_at_their_share_and_leaves_the_rest_to_requests():
    budget = MemoryBudget(limit=1000, kept_share=0.5)
    budget.keep(400, "sequence 'a''s keys and values")
    with pytest.raises(RequestError) as refused:
        budget.keep(200, "sequence 'b''s keys and values")
    assert refused.value.kind == ErrorKind.RESOURCE_EXHAUSTED
    assert "--sequence-bytes-share 0.5 of --max-inflight-bytes 1000 (500 bytes" in refused.value.message
    budget.take(600, "the request as received")  # the half kept for stateless requests is there
    assert budget.kept_bytes == 400


def test_a_model_that_batches_where_the_flags_did_not_widens_the_estimate_never_narrows_it():
    budget = MemoryBudget(limit=10_000, workers=1, max_batch_size=None)
    budget.provide_for(max_batch_size=4, padded_runs=False)
    budget.provide_for(max_batch_size=2, padded_runs=True)
    assert (budget.max_batch_size, budget.padded_runs) == (4, True)
    budget.provide_for(max_batch_size=None, padded_runs=False)
    assert (budget.max_batch_size, budget.padded_runs) == (4, True)


@pytest.mark.parametrize("max_batch_size, padded", [(8, False), (8, True), (None, False)])
def test_what_waiting_runs_may_need_follows_requests_as_they_come_and_their_runs_end(max_batch_size, padded):
    """Kept up as requests come and go, the estimate is always the one made from every request waiting."""
    import heapq
    import random

    budget = MemoryBudget(limit=10**12, workers=2, max_batch_size=max_batch_size, padded_runs=padded)
    waiting: dict[object, tuple[int, int]] = {}

    def from_every_one() -> int:
        if not waiting:
            return 0
        total = sum(workspace for _, workspace in waiting.values())
        if max_batch_size is None:
            return min(total, sum(heapq.nlargest(2, (workspace for _, workspace in waiting.values()))))
        per_row = max(workspace / rows for rows, workspace in waiting.values())
        if padded:
            return int(per_row * min(sum(rows for rows, _ in waiting.values()), max_batch_size * 2))
        return min(total, int(per_row * max_batch_size * 2))

    rng = random.Random(5)
    for _ in range(2000):
        if waiting and rng.random() < 0.5:
            token = rng.choice(list(waiting))
            budget.run_ended(token)
            budget.release(waiting.pop(token)[0])
        else:
            rows, workspace = rng.randint(1, 8), rng.randint(1, 10_000)
            waiting[budget.admit(rows, rows, workspace)] = (rows, workspace)  # its rows as its bytes
        assert budget.held == sum(rows for rows, _ in waiting.values()) + from_every_one()
    assert len(budget._per_row) <= 2 * len(waiting) + 65  # entries of ended runs do not pile up


def test_memory_is_given_back_only_once_idle_for_the_whole_wait_since_the_last_request(monkeypatch):
    monkeypatch.setattr(accounting, "IDLE_RELEASE_S", 0.3)

    class Session:
        released_at: list[float] = []  # on the loop's clock (time.monotonic)

        def release_memory(self):
            Session.released_at.append(time.monotonic())

    async def scenario():
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as executor:
            requests = RequestAccounting(MemoryBudget(1 << 30), Metrics(), executor, lambda: [Session()])
            idle = Receipt(requests)
            idle.add(accounting.RECEIVED_BYTES_BEFORE_TRIM)  # enough received to be worth giving back
            idle.close()
            await asyncio.sleep(0.2)
            request = Receipt(requests)  # a request comes and goes before the wait is up
            request.add(1000)
            await asyncio.sleep(0.05)
            request.close()
            idle_again = loop.time()  # the first wait ends 0.05 s later, a whole wait since the request 0.3 s later
            while not Session.released_at and loop.time() < idle_again + 5:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert len(Session.released_at) == 1 and Session.released_at[0] - idle_again >= 0.3

    asyncio.run(scenario())


def test_a_request_that_does_not_fit_yet_waits_its_turn_for_the_memory_admitted_requests_give_back():
    async def scenario():
        # Of 1000, the requests admitted hold at most 500 while one is in flight; the rest is for requests received.
        budget = MemoryBudget(limit=1000, workers=1, max_batch_size=None)
        first = budget.admit_now(request_bytes=300, rows=1, workspace=100)
        budget.take(50, "the request as received")  # the second and third, received
        budget.take(50, "the request as received")
        second = asyncio.ensure_future(budget.admit_in_turn(300, 1, 100, received=50))
        third = asyncio.ensure_future(budget.admit_in_turn(150, 1, 50, received=50))
        await asyncio.sleep(0)
        assert not second.done() and not third.done() and budget.waiting_for_memory == 2
        assert budget.admit_now(10, 1, 10) is None  # a small one, that would fit, passes none of those waiting
        budget.run_ended(first)
        budget.release(300)  # the first answered: the second fits, the third now waits for it
        await asyncio.sleep(0)
        assert second.done() and not third.done() and budget.waiting_for_memory == 1
        assert budget.held == 400 + 50 and budget.received_bytes == 50  # its share, for what it held as received
        budget.run_ended(second.result())
        budget.release(300)
        await asyncio.sleep(0)
        assert third.done() and budget.waiting_for_memory == 0 and budget.received_bytes == 0
        budget.run_ended(third.result())
        budget.release(150)
        assert budget.held == 0 and budget.idle

    asyncio.run(scenario())


def test_a_request_is_refused_at_once_where_waiting_for_memory_cannot_help():
    async def scenario():
        budget = MemoryBudget(limit=1000)
        with pytest.raises(InflightBytesExceeded):  # larger than the whole budget
            await budget.admit_in_turn(900, 1, 200)
        budget.keep(600, "a sequence's keys and values")
        with pytest.raises(InflightBytesExceeded):  # no request admitted is in flight to give memory back
            await budget.admit_in_turn(300, 1, 200)
        budget.let_go(600)
        budget.admit_now(200, 1, 100)  # in flight
        budget.take(300, "the request as received")
        waiting = asyncio.ensure_future(budget.admit_in_turn(300, 1, 100, received=300))
        await asyncio.sleep(0)
        budget.take(250, "the request as received")
        with pytest.raises(RequestError) as refused:  # those waiting would hold more than their half
            await budget.admit_in_turn(10, 1, 10, received=250)
        assert refused.value.kind is ErrorKind.RESOURCE_EXHAUSTED and refused.value.shed_by == "memory"
        assert "would join the 1 waiting for memory, which hold 300 bytes" in refused.value.message
        assert "max_inflight_bytes=1000 (500 bytes)" in refused.value.message
        waiting.cancel()

    asyncio.run(scenario())


def test_the_first_in_line_is_refused_once_nothing_admitted_is_left_to_give_memory_back():
    async def scenario():
        budget = MemoryBudget(limit=1000)
        first = budget.admit_now(100, 1, 100)
        budget.take(50, "the request as received")
        waiting = asyncio.ensure_future(budget.admit_in_turn(400, 1, 200, received=50))
        await asyncio.sleep(0)
        budget.keep(450, "a sequence's keys and values")  # a sequence grew meanwhile: 450 + 600 leaves no room
        budget.run_ended(first)
        budget.release(100)
        with pytest.raises(InflightBytesExceeded):
            await waiting
        assert budget.waiting_for_memory == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("when", ["waiting", "admitted before it resumed"])
def test_a_waiting_request_cancelled_leaves_the_budget_as_it_found_it(when):
    async def scenario():
        budget = MemoryBudget(limit=1000, workers=1, max_batch_size=None)
        first = budget.admit_now(300, 1, 100)
        budget.take(50, "the request as received")
        held_before = budget.held
        waiting = asyncio.ensure_future(budget.admit_in_turn(300, 1, 100, received=50))
        await asyncio.sleep(0)
        if when != "waiting":
            budget.run_ended(first)
            budget.release(300)  # admitted: its share taken, its task not yet resumed
            held_before = budget.held - 300 - 100 + 50
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert budget.waiting_for_memory == 0 and budget.held == held_before and budget.received_bytes == 50
        budget.release_received(50)  # its receipt closed as its call ends

    asyncio.run(scenario())


@pytest.mark.parametrize("bound", ["deadline", "queue timeout"])
def test_a_call_that_waits_for_memory_past_its_deadline_or_queue_timeout_is_refused_and_gives_back_what_it_held(bound):
    async def scenario():
        with ThreadPoolExecutor(1) as executor:
            requests = RequestAccounting(MemoryBudget(10_000), Metrics(), executor, lambda: [])
            in_flight = requests.budget.admit_now(5000, 1, 0)
            call = accounting.CallMemory(requests)
            call.receipt.add(100)
            rows = np.zeros((1, 4, 8), np.float32)  # a request of a few hundred bytes, behind one of 5000
            attention = RunInputs(rows, rows, rows, np.ones((1, 1, 4, 4), bool), ("output",))
            started = time.monotonic()
            signature = ModelSignature("mha", "1", 8, 2)
            with pytest.raises(RequestError) as refused:
                if bound == "deadline":
                    await call.admit(attention, signature, timeout_s=0.2, queue_timeout=QueueTimeout(5, "its model's"))
                else:
                    await call.admit(attention, signature, timeout_s=5, queue_timeout=QueueTimeout(0.2, "its model's"))
            assert 0.2 <= time.monotonic() - started < 2
            said = refused.value.message
            if bound == "deadline":
                assert refused.value.kind is ErrorKind.DEADLINE_EXCEEDED
                assert "waiting for memory (--max-inflight-bytes); the request was not computed" in said
            else:  # as Triton answers a queue timeout
                assert refused.value.kind is ErrorKind.UNAVAILABLE and "past its queue timeout of 200 ms" in said
            call.call_ended()
            requests.budget.run_ended(in_flight)
            requests.budget.release(5000)
            assert requests.budget.held == 0 and requests.budget.waiting_for_memory == 0

    asyncio.run(scenario())


def test_memory_held_only_by_answers_not_read_is_waited_for_a_grace_then_those_waiting_are_refused(monkeypatch):
    # A client that never reads its answers holds their memory until its connection goes: its other requests, and
    # everyone's behind them, must not wait on it for ever.
    monkeypatch.setattr(memory, "DELIVERY_GRACE_S", 0.2)

    async def scenario():
        budget = MemoryBudget(limit=1000, workers=1, max_batch_size=None)
        budget.run_ended(budget.admit_now(700, 1, 50))  # run, its answer (700) not yet read
        budget.take(20, "the request as received")
        budget.take(20, "the request as received")
        started = time.monotonic()
        first = asyncio.ensure_future(budget.admit_in_turn(300, 1, 50, received=20))
        second = asyncio.ensure_future(budget.admit_in_turn(300, 1, 50, received=20))
        results = await asyncio.wait_for(asyncio.gather(first, second, return_exceptions=True), 10)
        assert [type(result) for result in results] == [InflightBytesExceeded, InflightBytesExceeded]
        assert 0.2 <= time.monotonic() - started < 2  # one grace, for the whole line
        with pytest.raises(InflightBytesExceeded):  # no memory is coming back: refused at once, as without waits
            await budget.admit_in_turn(300, 1, 50)
        small = budget.admit_now(40, 1, 10)  # what fits is admitted
        assert small is not None
        budget.release(700)  # the answer read at last: waits are worth it again
        budget.take(20, "the request as received")
        waiting = asyncio.ensure_future(budget.admit_in_turn(300, 1, 450, received=20))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # a run waits: its memory comes back
        budget.run_ended(small)
        budget.release(40)
        assert (await asyncio.wait_for(waiting, 10)) is not None

    asyncio.run(scenario())
