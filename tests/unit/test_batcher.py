"""The batcher in process: merged and split runs give each request its unbatched answer, and the run planner
keeps equal lengths together and splits where padding costs more."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mhaserve.server.batcher import merge, split
from mhaserve.server.graphs import AttentionGraphs
from tests.support import SMALL_D_MODEL, rand
from tests.support.requests import as_attention_request, mixed_requests

D = SMALL_D_MODEL


def test_merged_run_gives_each_request_its_unbatched_answer(small_model_dir):
    session = AttentionGraphs.open(small_model_dir, device="cpu", intra_op_threads=1)
    requests = [as_attention_request(*r) for r in mixed_requests(12)]
    merged = merge(requests)
    assert merged.query.shape[0] == sum(r.batch_size for r in requests)
    assert merged.query.shape[1] == max(r.query.shape[1] for r in requests)
    arrays = session.run(merged.outputs, merged.query, merged.key, merged.value, merged.mask)
    answers, errors = split(merged, dict(zip(merged.outputs, arrays, strict=True)), requests)
    assert errors == [None] * len(requests)
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


def test_the_fixed_price_of_a_run_survives_the_large_shapes_noise():
    from mhaserve.server.run_cost import FIT_SHAPES, RunCost

    # A shared machine's noise, a fifth of each timing either way, is milliseconds at the large shapes and
    # swamped the fixed price when the fit minimised the absolute error (0 to 4.7 ms for a true 1.2 ms).
    features = np.array([(1.0, r * (lq + lk), r * lq * lk) for r, lq, lk in FIT_SHAPES])
    truth = np.array([1.2e-3, 6e-5, 3e-8])
    rng = np.random.default_rng(0)
    for _ in range(20):
        fitted = RunCost.from_samples(features, features @ truth * rng.uniform(0.8, 1.2, len(features)))
        assert 0.8e-3 < fitted.overhead_s < 1.6e-3, fitted


def test_a_fitted_cost_is_kept_under_what_it_depends_on_and_anything_unreadable_is_fitted_again(tmp_path, caplog):
    from mhaserve.server.run_cost import FittedCosts, RunCost

    kept = FittedCosts(tmp_path / "run-costs")
    cost = RunCost(2.1e-3, 5.5e-8, 2.5e-11)
    key = kept.key(graph="ab12", shapes=[(1, 8, 8)], threads=[2, 0, -1.0])
    assert kept.get(key) is None  # nothing fitted yet
    kept.put(key, cost)
    got, fitted_at = kept.get(key)
    assert got == cost and fitted_at.startswith("20")
    # another graph, other shapes or other threads: another fit
    assert key != kept.key(graph="cd34", shapes=[(1, 8, 8)], threads=[2, 0, -1.0])
    assert key != kept.key(graph="ab12", shapes=[(1, 8, 4)], threads=[2, 0, -1.0])
    assert key != kept.key(graph="ab12", shapes=[(1, 8, 8)], threads=[1, 0, -1.0])
    assert FittedCosts(tmp_path / "elsewhere").get(key) is None
    # a file cut short or of another layout is read as none, and fitted again over
    (tmp_path / "run-costs" / f"{key}.json").write_text('{"overhead_s": 0.002')
    assert kept.get(key) is None
    (tmp_path / "run-costs" / f"{key}.json").write_text('{"overhead_s": "x", "fitted_at": "today"}')
    assert kept.get(key) is None
    prices = '"overhead_s": 0.002, "per_token_s": -1e-7, "per_pair_s": 0'
    (tmp_path / "run-costs" / f"{key}.json").write_text(f'{{{prices}, "fitted_at": "today"}}')
    assert kept.get(key) is None  # a price no fit makes
    (tmp_path / "run-costs" / f"{key}.json").write_text(f'{{{prices.replace("-1e-7", "NaN")}, "fitted_at": "x"}}')
    assert kept.get(key) is None
    kept.put(key, cost)
    assert kept.get(key)[0] == cost
    assert [p.name for p in (tmp_path / "run-costs").iterdir()] == [f"{key}.json"]  # no temporary file left
    # a folder that cannot be written keeps nothing and says so; None keeps nothing at all
    (tmp_path / "file").write_text("")
    with caplog.at_level("INFO", logger="mhaserve.server"):
        FittedCosts(tmp_path / "file" / "run-costs").put(key, cost)
    assert "not kept for later starts" in caplog.text
    FittedCosts(None).put(key, cost)
    assert FittedCosts(None).get(key) is None


def queued_then_taken(session, requests, run_cost, max_batch_size=64):
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

    session = AttentionGraphs.open(small_model_dir, device="cpu", intra_op_threads=1)
    requests = [as_attention_request(*r) for r in mixed_requests(16, seed=9)]
    answers, runs = queued_then_taken(session, requests, RunCost(1e-9, 0.0, 1.0))
    lengths = {(r.query.shape[1], r.key.shape[1]) for r in requests}
    assert len(runs) == len(lengths) > 1  # one run per distinct (Lq, Lk): no padding paid for
    assert all(run.padding_ratio == 0.0 for run in runs)
    for request, answer in zip(requests, answers, strict=True):
        alone = session.run(request.outputs, request.query, request.key, request.value, request.mask)
        for name, want in zip(request.outputs, alone, strict=True):
            np.testing.assert_allclose(answer.outputs[name], want, rtol=0, atol=1e-5)


def test_a_mixed_take_looks_down_the_queue_and_runs_the_oldest_request_first(small_model_dir):
    from mhaserve.server.run_cost import RunCost

    session = AttentionGraphs.open(small_model_dir, device="cpu", intra_op_threads=1)

    def request(length, seed):
        return as_attention_request(rand(1, length, D, seed=seed), None, None, None, False)

    def runs_made(requests):
        _, runs = queued_then_taken(session, requests, RunCost(1e-3, 1e-6, 0.0), max_batch_size=4)
        return [(run.batch_size, run.q_len) for run in runs]

    # A long request queued first, then short and long ones alternating: the head's four rows alone would
    # make two half-full runs. Looking further, the take makes full runs of one length each, never over
    # the batch limit, and the run holding the oldest request (the long one) goes first.
    queued = [request(60, 0)] + [request(2 if i % 2 else 60, i) for i in range(1, 8)]
    assert runs_made(queued) == [(4, 60), (4, 2)]
    # Equal lengths take what they took before: one run of the batch limit per take.
    assert runs_made([request(8, i) for i in range(8)]) == [(4, 8), (4, 8)]


def test_an_answer_with_nan_or_inf_is_refused_and_the_output_vouches_for_the_weights():
    from mhaserve.server.outputs import overflow_error

    weights = np.full((1, 2, 3, 3), 1 / 3, dtype=np.float32)
    output = np.ones((1, 3, 4), dtype=np.float32)
    both = ("output", "attn_weights")
    assert overflow_error(both, output, weights) is None
    nan_output = output.copy()
    nan_output[0, 1, 2] = np.nan  # as a NaN weight makes its row's output through P·V
    assert "output 'output' has 1 non-finite" in overflow_error(both, nan_output, weights).message
    nan_weights = weights.copy()
    nan_weights[0, 0, 1] = np.nan
    # No output to vouch: the weights every weights output is cut from are summed, whatever was asked of them.
    refused = overflow_error(("attn_top_k_indices",), None, nan_weights, "float16")
    assert "overflowed float16: output 'attn_weights' has 3 non-finite" in refused.message
    assert "from which attn_top_k_indices would be cut" in refused.message
    assert "output 'output' has 1" in overflow_error(both, np.float32([np.inf]), weights).message


async def worker_freed(batcher) -> None:
    for _ in range(500):
        if batcher._idle_workers:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the worker was not freed within 5 s")


def test_a_failed_run_fails_its_requests_and_the_worker_serves_the_next_take(small_model_dir):
    # A run that raised fails its requests alone, and the worker is freed once its take's runs are over (by a
    # wake of its own, after the last run's answers): after the failed run, and after a take of two runs, the next
    # request is taken and answered, and the worker is free again after it.
    from concurrent.futures import ThreadPoolExecutor

    from mhaserve.server.batcher import Batcher
    from mhaserve.server.run_cost import RunCost

    session = AttentionGraphs.open(small_model_dir, device="cpu", intra_op_threads=1)
    calls = []

    def run_model(*args):
        calls.append(args[1].shape)
        if len(calls) == 1:
            raise RuntimeError("the model's run failed")
        return session.run(*args)

    def request(length, seed):
        return as_attention_request(rand(1, length, D, seed=seed), None, None, None, False)

    async def scenario():
        with ThreadPoolExecutor(1) as executor:
            each_length_alone = RunCost(1e-9, 0.0, 1.0)
            batcher = Batcher(run_model, executor, workers=1, max_batch_size=4, max_queue_size=64,
                              run_cost=each_length_alone)  # fmt: skip
            with pytest.raises(RuntimeError, match="the model's run failed"):
                await batcher.submit(request(3, 0))
            await worker_freed(batcher)  # the wake that frees the worker follows its answers
            batcher._idle_workers = 0  # hold the worker: one take of two lengths, two runs
            mixed = [asyncio.ensure_future(batcher.submit(request(length, i))) for i, length in enumerate((2, 60))]
            await asyncio.sleep(0)
            batcher._idle_workers = 1
            batcher._dispatch()
            answers = await asyncio.gather(*mixed)
            after = await asyncio.wait_for(batcher.submit(request(5, 9)), 30)
            await worker_freed(batcher)
            return answers, after, batcher._idle_workers

    answers, after, idle = asyncio.run(scenario())
    assert [a.outputs["output"].shape for a in answers] == [(1, 2, D), (1, 60, D)]
    assert len(calls) == 4 and after.outputs["output"].shape == (1, 5, D) and idle == 1


def test_a_lone_small_request_runs_on_the_event_loop_and_requests_back_to_back_on_a_worker(
    small_model_dir, monkeypatch
):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from mhaserve.server import batcher as batcher_module
    from mhaserve.server.batcher import QUIET_BEFORE_RUN_HERE_NS, Batcher

    session = AttentionGraphs.open(small_model_dir, device="cpu", intra_op_threads=1)
    ran_on, asked = [], []

    def run_model(*args):
        ran_on.append((args[1].shape[1], threading.current_thread().name))
        if args[1].shape[1] == 7:
            raise RuntimeError("the model's run failed")
        return session.run(*args)

    def runs_here(rows, q_len, kv_len):
        asked.append((rows, q_len, kv_len))
        return q_len <= 16  # a small run, the server otherwise quiet

    def request(length, seed):
        return as_attention_request(rand(1, length, D, seed=seed), None, None, None, False)

    async def quiet_for_a_while():
        await asyncio.sleep(3 * QUIET_BEFORE_RUN_HERE_NS / 1e9)

    async def scenario():
        with ThreadPoolExecutor(1, thread_name_prefix="worker") as executor:
            batcher = Batcher(run_model, executor, workers=1, max_batch_size=4, max_queue_size=64, runs_here=runs_here)
            answers = [await batcher.submit(request(5, 0))]  # lone and small: here
            await quiet_for_a_while()
            with pytest.raises(RuntimeError, match="the model's run failed"):  # a failed run here is its caller's
                await batcher.submit(request(7, 1))
            await quiet_for_a_while()
            # Too large for here (runs_here says no): a worker's; one that comes while it runs waits for the
            # worker, and is taken as the run ends, back to back with it: a worker's too.
            large = asyncio.ensure_future(batcher.submit(request(40, 2)))
            await asyncio.sleep(0)
            answers += await asyncio.gather(large, batcher.submit(request(6, 3)))
            await worker_freed(batcher)
            await quiet_for_a_while()
            # A run ended within the quiet window (here as long as the test): one of many callers, back to back.
            monkeypatch.setattr(batcher_module, "QUIET_BEFORE_RUN_HERE_NS", 100 * 10**9)
            answers.append(await batcher.submit(request(4, 4)))
            return threading.current_thread().name, answers

    loop_thread, answers = asyncio.run(scenario())
    assert ran_on == [(5, loop_thread), (7, loop_thread), (40, "worker_0"), (6, "worker_0"), (4, "worker_0")]
    assert asked == [(1, 5, 5), (1, 7, 7), (1, 40, 40)]  # the last two were not lone
    for answer, length in zip(answers, (5, 40, 6, 4), strict=True):
        assert answer.outputs["output"].shape == (1, length, D)


def test_requests_waiting_for_memory_count_as_queued_and_keep_their_place_once_admitted(small_model_dir):
    from concurrent.futures import ThreadPoolExecutor

    from mhaserve.server.batcher import Batcher, QueueFull

    session = AttentionGraphs.open(small_model_dir, device="cpu", intra_op_threads=1)

    def request(length: int, seed: int):
        return as_attention_request(rand(1, length, D, seed=seed), None, None, None, False)

    async def scenario():
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(session.run, executor, workers=1, max_batch_size=4, max_queue_size=3)
            batcher._idle_workers = 0  # hold the worker: requests stay queued
            memory = [loop.create_future() for _ in range(3)]
            waiting = [
                asyncio.ensure_future(batcher.submit(request(2 + i, i), admit=lambda given=given: given))
                for i, given in enumerate(memory)
            ]
            await asyncio.sleep(0)
            with pytest.raises(QueueFull):  # three wait for memory: the queue has no room for a fourth
                await batcher.submit(request(5, 5))
            waiting[2].cancel()  # one gives up while it waits: its place is free again
            await asyncio.sleep(0)
            queued = asyncio.ensure_future(batcher.submit(request(6, 6)))
            await asyncio.sleep(0)
            for given in memory[:2]:  # the other two admitted: they queue in the places they held
                given.set_result(None)
            await asyncio.sleep(0)
            assert batcher.queue_depth == 3
            with pytest.raises(QueueFull):
                await batcher.submit(request(7, 7))
            batcher._idle_workers = 1
            batcher._dispatch()
            return await asyncio.wait_for(asyncio.gather(waiting[0], waiting[1], queued), 30)

    answers = asyncio.run(scenario())
    assert [answer.outputs["output"].shape for answer in answers] == [(1, 2, D), (1, 3, D), (1, 6, D)]


def test_a_request_waiting_for_memory_counts_against_its_priority_levels_bound(small_model_dir):
    from concurrent.futures import ThreadPoolExecutor

    from mhaserve.server.batcher import Batcher, QueueFull, QueueTerms

    session = AttentionGraphs.open(small_model_dir, device="cpu", intra_op_threads=1)
    first, second = (QueueTerms(priority=level, level_queue_size=1, level_set_by="the test") for level in (1, 2))

    async def scenario():
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1) as executor:
            batcher = Batcher(session.run, executor, workers=1, max_batch_size=4, max_queue_size=8)
            memory = loop.create_future()
            waiting = asyncio.ensure_future(
                batcher.submit(
                    as_attention_request(rand(1, 2, D), None, None, None, False), terms=first, admit=lambda: memory
                )
            )
            await asyncio.sleep(0)
            with pytest.raises(QueueFull, match="priority level 1"):
                await batcher.submit(as_attention_request(rand(1, 3, D), None, None, None, False), terms=first)
            other_level = await asyncio.wait_for(
                batcher.submit(as_attention_request(rand(1, 4, D), None, None, None, False), terms=second), 30
            )
            memory.set_result(None)
            return await asyncio.wait_for(waiting, 30), other_level

    answers = asyncio.run(scenario())
    assert [answer.outputs["output"].shape for answer in answers] == [(1, 2, D), (1, 4, D)]
