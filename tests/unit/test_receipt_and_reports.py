"""Small pieces at the transports' and the load test's edges, each alone: the stream slots (how many inference
streams one client may hold) and reads (how many read at once), a folder taken for a repository, and a load test's
verdict per SLO."""

from __future__ import annotations

import asyncio

import numpy as np

from mhaserve.contract.repository import ModelRepository
from mhaserve.loadtest.loadgen import Point, PointResult, Workload
from mhaserve.loadtest.slo import parse_slo, summary, summary_lines
from mhaserve.server.grpc.receipt import StreamReads, StreamSlots


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


def test_streams_read_a_few_at_a_time_in_the_order_they_asked_and_a_stream_gone_passes_its_turn_on():
    async def scenario():
        reads, order = StreamReads(limit=1), []

        async def stream(name: str, hold: asyncio.Event):
            async with reads.reading():
                order.append(name)
                await hold.wait()

        first, second, third = asyncio.Event(), asyncio.Event(), asyncio.Event()
        a = asyncio.create_task(stream("a", first))
        await asyncio.sleep(0)
        b = asyncio.create_task(stream("b", second))
        c = asyncio.create_task(stream("c", third))
        await asyncio.sleep(0.01)
        assert order == ["a"]  # one reads; the others wait, unread
        b.cancel()  # gone while waiting: it takes no turn
        first.set()
        third.set()
        await asyncio.gather(a, c)
        assert order == ["a", "c"]
        async with reads.reading():  # every turn given back
            pass

    asyncio.run(scenario())


def test_with_no_limit_every_stream_reads_at_once():
    async def scenario():
        reads = StreamReads(limit=0)
        async with reads.reading(), reads.reading(), reads.reading():
            return True

    assert asyncio.run(scenario())
