"""Dynamic batching: requests of different lengths, masks and outputs share a model run and each gets its
own unbatched answer; the queue is bounded; expired and cancelled requests are never computed."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import AsyncClient, Client, build_infer_request
from mhaserve.server.batcher import merge, split
from mhaserve.server.grpc.protobuf import decode_infer_request
from mhaserve.server.session import AttentionSession
from mhaserve.server.tensors import AttentionRequest, Limits, ModelSignature
from mhaserve.testing.server_process import ServerProcess

from .conftest import SMALL_D_MODEL, SMALL_HEADS, eager, inflight_and_counts, rand, scrape

D = SMALL_D_MODEL


def mixed_requests(count: int, seed: int = 0):
    """(query, key, value, mask, attn_weights): lengths 1..48, self- and cross-attention, with and without masks."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        batch, q_len = int(rng.integers(1, 4)), int(rng.integers(1, 49))
        query = rand(batch, q_len, D, seed=1000 * seed + i)
        key = value = None
        kv_len = q_len
        if i % 3 == 1:  # cross-attention
            kv_len = int(rng.integers(1, 49))
            key, value = rand(batch, kv_len, D, seed=7 + i), rand(batch, kv_len, D, seed=11 + i)
        mask = None
        if i % 4 == 2:  # key padding
            mask = rng.random((batch, kv_len)) < 0.7
            mask[:, 0] = True
        elif i % 4 == 3:  # full mask with a fully masked row
            mask = (rng.random((batch, q_len, kv_len)) < 0.6).astype(np.int32)
            mask[:, :, 0] = 1
            mask[0, q_len // 2, :] = 0
        requests.append((query, key, value, mask, i % 5 != 4))
    return requests


def as_attention_request(query, key, value, mask, attn_weights) -> AttentionRequest:
    """Decoded as the server decodes it: the client's request through the codec."""
    request = build_infer_request("mha", query, key, value, mask, attn_weights)
    return decode_infer_request(request, ModelSignature("mha", "1", D, SMALL_HEADS), Limits(64, 64, 64))


def test_merged_run_gives_each_request_its_unbatched_answer(small_model_dir):
    session = AttentionSession(small_model_dir, device="cpu", intra_op_threads=1)
    requests = [as_attention_request(*r) for r in mixed_requests(12)]
    merged = merge(requests)
    assert merged.query.shape[0] == sum(r.batch_size for r in requests)
    assert merged.query.shape[1] == max(r.query.shape[1] for r in requests)
    arrays = session.run(merged.outputs, merged.query, merged.key, merged.value, merged.mask)
    answers = split(merged, dict(zip(merged.outputs, arrays, strict=True)), [r.outputs for r in requests])
    for request, answer in zip(requests, answers, strict=True):
        alone = dict(zip(request.outputs, session.run(request.outputs, request.query, request.key, request.value,
                                                      request.mask), strict=True))  # fmt: skip
        assert answer.keys() == alone.keys()
        for name in alone:
            assert answer[name].shape == alone[name].shape
            assert np.isfinite(answer[name]).all()
            np.testing.assert_allclose(answer[name], alone[name], rtol=0, atol=1e-5)


def test_equal_lengths_without_masks_merge_without_padding():
    requests = [as_attention_request(rand(2, 8, D, seed=s), None, None, None, True) for s in range(3)]
    merged = merge(requests)
    assert merged.query.shape == (6, 8, D)
    assert merged.key is merged.query  # self-attention stays one array
    assert merged.mask.shape == (1, 1, 1, 8) and merged.mask.all()


@pytest.fixture(scope="module")
def batching_server(small_model_dir):
    # A 30 ms queue delay makes merging certain in a test; the default (0) merges only under load.
    args = ("--max-batch-size", "64", "--max-q-len", "64", "--max-kv-len", "64", "--max-queue-delay-us", "30000")
    with ServerProcess(small_model_dir, *args, "--warmup-runs", "1") as process:
        yield process


def infer_concurrently(url: str, requests) -> list:
    """Every one of ``mixed_requests``'s requests sent at once from one asyncio client; the results in order."""

    async def call_all():
        async with AsyncClient(url) as client:
            return await asyncio.gather(
                *(client.infer(q, k, v, m, attn_weights=w, timeout=60) for q, k, v, m, w in requests)
            )

    return asyncio.run(call_all())


def test_concurrent_mixed_lengths_each_equal_eager(batching_server, small_module):
    requests = mixed_requests(24, seed=3)
    with Client(batching_server.url) as client:
        before = client.statistics()
        results = infer_concurrently(batching_server.url, requests)
        after = client.statistics()
    for (query, key, value, mask, weights), result in zip(requests, results, strict=True):
        want_out, want_attn = eager(small_module, query, key, value, mask)
        np.testing.assert_allclose(result.output, want_out, rtol=0, atol=1e-5)
        if weights:
            np.testing.assert_allclose(result.attn_weights, want_attn, rtol=0, atol=1e-5)
        else:
            assert result.attn_weights is None
    runs = after.execution_count - before.execution_count
    rows = after.inference_count - before.inference_count
    assert rows == sum(q.shape[0] for q, *_ in requests)
    assert runs < len(requests) // 2, f"{len(requests)} concurrent requests took {runs} runs: not merged"
    assert any(b.batch_size > 3 for b in after.batch_stats)  # more rows than any one request has


def test_batching_off_runs_each_request_alone(small_model_dir):
    with ServerProcess(small_model_dir, "--dynamic-batching", "false", "--warmup-runs", "0") as server:
        requests = mixed_requests(8, seed=5)

        async def call_all():
            async with AsyncClient(server.url) as client:
                return await asyncio.gather(*(client.infer(q, k, v, m, timeout=60) for q, k, v, m, _ in requests))

        results = asyncio.run(call_all())
        with Client(server.url) as client:
            stats = client.statistics()
    assert len(results) == 8 and stats.execution_count == 8


# Slow enough (about 20-60 ms a run at d_model 64) that a queue builds behind it.
def slow_query(seed=0):
    return rand(16, 384, D, seed=seed)


def pending_requests(server) -> float:
    samples = scrape(server.metrics_url)
    return sum(value for (name, _), value in samples.items() if name == "mhaserve_inference_pending_request_count")


def test_full_queue_refuses_at_once_and_serves_what_it_accepted(small_model_dir, small_module):
    args = ("--max-queue-size", "2", "--max-batch-size", "16", "--max-q-len", "384", "--max-kv-len", "384")
    with ServerProcess(small_model_dir, *args, "--warmup-runs", "0") as server:
        queries = [slow_query(seed) for seed in range(12)]

        async def timed(client, query):
            started = time.perf_counter()
            try:
                result = await client.infer(query, attn_weights=False, timeout=120)
                return "OK", result, time.perf_counter() - started
            except grpc.aio.AioRpcError as error:
                return error.code(), error.details(), time.perf_counter() - started

        async def call_all():
            async with AsyncClient(server.url) as client:
                return await asyncio.gather(*(timed(client, q) for q in queries))

        outcomes = asyncio.run(call_all())
        with Client(server.url) as client:
            stats = client.statistics()
            assert client.infer(rand(1, 4, D)).output.shape == (1, 4, D)  # still serving
    refused = [o for o in outcomes if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = [(q, o) for q, o in zip(queries, outcomes, strict=True) if o[0] == "OK"]
    assert len(refused) + len(served) == len(queries), [o[0] for o in outcomes]
    assert refused and served
    assert all("queue is full" in details and "max_queue_size=2" in details for _, details, _ in refused)
    slowest_served = max(seconds for _, (_, _, seconds) in served)
    assert all(seconds < slowest_served for *_, seconds in refused)  # refused at once, not after waiting
    for query, (_, result, _) in served:
        np.testing.assert_allclose(result.output, eager(small_module, query)[0], rtol=0, atol=1e-5)
    assert stats.inference_count == 16 * len(served)  # the refused ones were never computed


@pytest.mark.parametrize("fault", ["deadline", "cancel"])
def test_expired_or_cancelled_requests_leave_the_queue_uncomputed(small_model_dir, fault):
    # One long run holds the one worker for a few hundred milliseconds; a marker queued behind it shows the
    # victims will queue too. (Eight slow requests used to stand in for it, awaited until seven were queued:
    # when the worker kept up with their decoding, seven never were, and the test waited for ever.)
    args = ("--max-batch-size", "16", "--max-q-len", "1024", "--max-kv-len", "1024", "--dynamic-batching", "false")
    with ServerProcess(small_model_dir, *args, "--max-inflight-bytes", str(4 << 30), "--warmup-runs", "0") as server:

        async def until(condition, what: str) -> None:
            deadline = time.monotonic() + 30
            while not await asyncio.to_thread(condition):
                assert time.monotonic() < deadline, f"{what} did not happen within 30 s"
                await asyncio.sleep(0.005)

        async def scenario():
            async with AsyncClient(server.url) as client:
                blocker = asyncio.create_task(client.infer(rand(16, 1024, D), attn_weights=False, timeout=120))
                await until(lambda: inflight_and_counts(server)[0] > 0, "the long request's admission")
                marker = asyncio.create_task(client.infer(rand(1, 4, D), timeout=120))
                await until(lambda: pending_requests(server) >= 1, "the marker's queueing")
                if fault == "deadline":
                    victims = [client.infer(rand(1, 4, D), timeout=0.05) for _ in range(5)]
                    outcomes = await asyncio.gather(*victims, return_exceptions=True)
                    codes = {e.code() for e in outcomes}
                    assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED}, codes
                else:
                    victims = [asyncio.create_task(client.infer(rand(1, 4, D), timeout=60)) for _ in range(5)]
                    await asyncio.sleep(0.05)
                    for task in victims:
                        task.cancel()
                    outcomes = await asyncio.gather(*victims, return_exceptions=True)
                    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
                return await asyncio.gather(blocker, marker)

        asyncio.run(scenario())
        with Client(server.url) as client:
            stats = client.statistics()
            assert client.infer(rand(1, 4, D)).output.shape == (1, 4, D)
    # Only the long request (16 rows) and the marker were ever computed; the five victims were dropped.
    assert stats.inference_count == 16 + 1
    assert stats.execution_count == 2


# Length-aware batching: what a free worker takes is split into runs by a cost model.


def test_plan_keeps_equal_lengths_together_and_splits_where_padding_costs_more():
    from mhaserve.server.run_cost import RunCost, plan_runs

    cost = RunCost(overhead_s=1e-3, per_token_s=1e-6, per_pair_s=1e-7)
    assert plan_runs([(1, 64, 64)] * 8, cost) == [list(range(8))]
    # Four short and four long: padding the short ones to 512 costs far more than one more run.
    shapes = [(1, 8, 8), (1, 512, 512)] * 4
    assert sorted(map(sorted, plan_runs(shapes, cost))) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # With a per-run price above any padding, one run it is.
    assert len(plan_runs(shapes, RunCost(overhead_s=10.0, per_token_s=1e-6, per_pair_s=1e-7))) == 1
    # No run over the row limit, though one run would be cheapest; a request alone over it still runs.
    assert [len(run) for run in plan_runs([(1, 64, 64)] * 8, cost, max_rows=3)] == [3, 3, 2]
    assert plan_runs([(5, 8, 8)], cost, max_rows=3) == [[0]]
    # The plan is never dearer than the single padded run it replaces.
    rng = np.random.default_rng(0)
    for _ in range(50):
        shapes = [(int(b), int(lq), int(lk)) for b, lq, lk in rng.integers(1, 300, size=(12, 3)) % [4, 300, 300] + 1]
        runs = plan_runs(shapes, cost)
        assert sorted(i for run in runs for i in run) == list(range(12))
        planned = sum(cost.padded_run_seconds([shapes[i] for i in run]) for run in runs)
        assert planned <= cost.padded_run_seconds(shapes) + 1e-12


def test_cost_fit_recovers_known_prices_and_never_goes_negative():
    from mhaserve.server.run_cost import RunCost

    features = np.array([(1.0, r * 2 * n, r * n * n) for r, n in ((1, 8), (1, 96), (4, 64), (8, 32), (2, 128))])
    fitted = RunCost.from_samples(features, features @ np.array([2e-4, 3e-6, 5e-8]))
    assert fitted.overhead_s == pytest.approx(2e-4) and fitted.per_pair_s == pytest.approx(5e-8)
    # noise that would make a price negative leaves it at zero instead
    fitted = RunCost.from_samples(features, features[:, 2] * 5e-8 - 1e-5)
    assert min(fitted.overhead_s, fitted.per_token_s, fitted.per_pair_s) >= 0


def queued_then_drained(session, requests, run_cost, max_batch_size=64):
    """The real batcher with one worker, held until every request is queued, then freed: (answers, runs made)."""
    from concurrent.futures import ThreadPoolExecutor

    from mhaserve.server.batcher import Batcher

    runs = []

    async def scenario():
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(session.run, executor, workers=1, max_batch_size=max_batch_size, max_queue_size=64,
                              on_batch=runs.append, run_cost=run_cost)  # fmt: skip
            batcher._idle_workers = 0  # hold the worker so every request is queued before the first plan
            submitted = [asyncio.ensure_future(batcher.submit(r)) for r in requests]
            await asyncio.sleep(0)
            batcher._idle_workers = 1
            batcher._dispatch()
            return await asyncio.gather(*submitted)

    return asyncio.run(scenario()), runs


def test_split_runs_give_each_request_its_unbatched_answer(small_model_dir):
    # The real batcher and session, with a cost model that makes every length its own run.
    from mhaserve.server.run_cost import RunCost

    session = AttentionSession(small_model_dir, device="cpu", intra_op_threads=1)
    requests = [as_attention_request(*r) for r in mixed_requests(16, seed=9)]
    answers, runs = queued_then_drained(session, requests, RunCost(1e-9, 0.0, 1.0))
    lengths = {(r.query.shape[1], r.key.shape[1]) for r in requests}
    assert len(runs) == len(lengths) > 1  # one run per distinct (Lq, Lk): no padding paid for
    assert all(run.padding_ratio == 0.0 for run in runs)
    for request, answer in zip(requests, answers, strict=True):
        alone = session.run(request.outputs, request.query, request.key, request.value, request.mask)
        for name, want in zip(request.outputs, alone, strict=True):
            np.testing.assert_allclose(answer.outputs[name], want, rtol=0, atol=1e-5)


def test_a_mixed_drain_looks_down_the_queue_and_runs_the_oldest_request_first(small_model_dir):
    from mhaserve.server.run_cost import RunCost

    session = AttentionSession(small_model_dir, device="cpu", intra_op_threads=1)

    def request(length, seed):
        return as_attention_request(rand(1, length, D, seed=seed), None, None, None, False)

    def runs_made(requests):
        _, runs = queued_then_drained(session, requests, RunCost(1e-3, 1e-6, 0.0), max_batch_size=4)
        return [(run.batch_size, run.q_len) for run in runs]

    # A long request queued first, then short and long ones alternating: the head's four rows alone would
    # make two half-full runs. Looking further, the drain makes full runs of one length each, never over
    # the batch limit, and the run holding the oldest request (the long one) goes first.
    queued = [request(60, 0)] + [request(2 if i % 2 else 60, i) for i in range(1, 8)]
    assert runs_made(queued) == [(4, 60), (4, 2)]
    # Equal lengths take what they took before: one run of the batch limit per drain.
    assert runs_made([request(8, i) for i in range(8)]) == [(4, 8), (4, 8)]


def test_padding_share_is_a_metric_and_the_flag_keeps_one_padded_run(small_model_dir, small_module):
    from .conftest import scrape

    requests = [(rand(1, 2, D, seed=s), None, None, None, True) for s in range(4)]
    requests += [(rand(1, 64, D, seed=10 + s), None, None, None, True) for s in range(4)]
    runs = {}
    for flag in ("false", "true"):
        args = ("--max-q-len", "64", "--max-kv-len", "64", "--max-queue-delay-us", "50000")
        with ServerProcess(small_model_dir, *args, "--length-aware-batching", flag, "--warmup-runs", "1") as server:

            async def call_all(server=server):
                async with AsyncClient(server.url) as client:
                    return await asyncio.gather(*(client.infer(q, timeout=60) for q, *_ in requests))

            results = asyncio.run(call_all())
            samples = scrape(server.metrics_url)
        for (query, *_), result in zip(requests, results, strict=True):
            np.testing.assert_allclose(result.output, eager(small_module, query)[0], rtol=0, atol=1e-5)
        count = {n: v for (n, _), v in samples.items() if n.startswith("mhaserve_inference_padding_ratio")}
        runs[flag] = (count["mhaserve_inference_padding_ratio_count"], count["mhaserve_inference_padding_ratio_sum"])
    # Off: the eight requests, gathered by the 50 ms queue delay, share one run padded to 64 (about half padding).
    assert runs["false"][0] == 1 and runs["false"][1] > 0.4
    # On: the server's fitted cost model decides; whatever it chose, no run is padded more than the single one.
    assert runs["true"][0] >= 1 and runs["true"][1] / runs["true"][0] <= runs["false"][1] + 1e-9
