"""Steps of several sequences in one call of the step graph (server/sequences.py StepRuns): those that gather while
a call is in progress share the next one when they carry the same number of new rows; short pasts of comparable
length run as one batch (several where one does not hold them), others in as few runs of the grouped step graph as
hold them, each over its own buffers (one after another where too few share a call, or the folder has no such
graph); each answer and grown cache equals its step run alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from mhaserve.server.graphs import AttentionGraphs
from mhaserve.server.sequences import StepRuns
from mhaserve.server.sequences.graph import (
    MIN_GROUPED_STEPS,
    STACKED_STEP_PAST_BYTES,
    STACKED_STEPS_BYTES,
    Step,
    StepCache,
    StepGraph,
)
from mhaserve.server.sequences.runtime import open_step_graphs
from tests.support import SMALL_D_MODEL, SMALL_HEADS


@pytest.fixture(scope="module")
def session(small_model_dir):
    """The folder's step graphs, as its sequence runtime opens them."""
    steps, cross_steps = open_step_graphs(AttentionGraphs.open(small_model_dir, "cpu", intra_op_threads=1))
    return SimpleNamespace(steps=steps, cross_steps=cross_steps)


def grown(session, length: int, seed: int):
    """A sequence's cache after a prompt of ``length`` rows."""
    prompt = np.random.default_rng(seed).standard_normal((1, length, SMALL_D_MODEL), dtype=np.float32)
    return session.steps.run_step(Step(prompt, session.steps.empty_cache(1)))[2]


def run_at_once(session, steps, max_rows=32) -> tuple[list, list[int]]:
    """The steps sent together, as concurrent requests do; their answers and the batch rows of each run they took
    (as the version's statistics count them: every step's rows in one run and one only)."""
    runs = []

    async def send():
        with ThreadPoolExecutor(1) as executor:
            step_runs = StepRuns(session.steps, executor, max_rows, on_runs=runs.extend)
            return await asyncio.gather(*(step_runs.run(Step(query, cache)) for query, cache in steps))

    answers = [(output, weights, cache) for (output, weights), cache in asyncio.run(send())]
    assert sum(run.rows for run in runs) == sum(query.shape[0] for query, _ in steps)
    assert all(run.ns > 0 for run in runs)
    return answers, [run.rows for run in runs]


def rows(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, count, SMALL_D_MODEL), dtype=np.float32)


def assert_equal_to_alone(session, steps, answers):
    for (query, cache), (output, weights, after) in zip(steps, answers, strict=True):  # each run alone
        alone = StepCache.of(cache.key.copy(), cache.value.copy(), cache.length)  # not the buffers run together
        want_output, want_weights, want_cache = session.steps.run_step(Step(query, alone))
        np.testing.assert_allclose(output, want_output, rtol=0, atol=1e-6)
        np.testing.assert_allclose(weights, want_weights, rtol=0, atol=1e-7)
        assert after.length == want_cache.length == cache.length + query.shape[1] and after.nbytes == want_cache.nbytes
        held = slice(0, after.length)
        np.testing.assert_allclose(after.key[:, :, held], want_cache.key[:, :, held], rtol=0, atol=1e-6)
        np.testing.assert_allclose(after.value[:, :, held], want_cache.value[:, :, held], rtol=0, atol=1e-6)


def test_steps_of_sequences_of_different_lengths_share_one_run_each_equal_to_its_run_alone(session):
    steps = [(rows(1, 10 + i), grown(session, length, i)) for i, length in enumerate((12, 17, 24, 20))]
    answers, runs = run_at_once(session, steps)
    assert runs == [4]
    assert_equal_to_alone(session, steps, answers)


def test_first_steps_of_sequences_started_together_share_one_run(session):
    steps = [(rows(2, 120 + i), session.steps.empty_cache(1)) for i in range(3)]  # no past yet
    answers, runs = run_at_once(session, steps)
    assert runs == [3]
    for (query, cache), (output, weights, after) in zip(steps, answers, strict=True):
        want_output, want_weights, want = session.steps.run_step(Step(query, cache))
        np.testing.assert_allclose(output, want_output, rtol=0, atol=1e-6)
        np.testing.assert_allclose(weights, want_weights, rtol=0, atol=1e-7)
        assert after.length == want.length == 2  # (alone, a first step's rows are its buffers exactly)
        np.testing.assert_allclose(after.key[:, :, :2], want.key, rtol=0, atol=1e-6)


def test_steps_of_other_new_rows_or_a_far_longer_past_or_past_the_rows_limit_run_apart(session):
    long = grown(session, 40, 2)
    # Calls of at most two rows: [0, 2], [1] (two new rows), [3, 4]; in the first, a past four times as long as
    # the other runs apart from it. (Each step has a sequence of its own: one sequence's steps run one at a time.)
    steps = [(rows(1, 3), grown(session, 10, 1)), (rows(2, 4), grown(session, 10, 1)), (rows(1, 5), long),
             (rows(1, 6), grown(session, 12, 3)),
             (rows(1, 7), grown(session, 11, 4))]  # fmt: skip
    answers, runs = run_at_once(session, steps, max_rows=2)
    assert sorted(runs) == [1, 1, 1, 2]
    assert_equal_to_alone(session, steps, answers)


def test_more_short_steps_than_one_batch_holds_run_in_batches_of_as_many_as_one_holds(session):
    # Pasts of about 500 rows: 15 steps' pasts fill one batch, so 31 steps take three runs (11, 11 and 9), not the
    # grouped graph's four (8, 8, 8 and 7).
    steps = [(rows(1, 90 + i), grown(session, 500 + i, 90 + i)) for i in range(31)]
    longest_bytes = 2 * (500 + 30) * SMALL_D_MODEL * 4
    assert longest_bytes <= STACKED_STEP_PAST_BYTES and STACKED_STEPS_BYTES // longest_bytes == 15
    answers, runs = run_at_once(session, steps, max_rows=64)
    assert runs == [11, 11, 9]
    assert_equal_to_alone(session, steps, answers)


def long_pasts(count: int, length: int = 1100, room: int = 4) -> list[StepCache]:
    """Caches too long to copy into a batch, of ``length`` rows and more, their buffers with ``room`` rows free."""
    heads, d_k = SMALL_HEADS, SMALL_D_MODEL // SMALL_HEADS
    assert 2 * length * SMALL_D_MODEL * 4 > STACKED_STEP_PAST_BYTES
    rng = np.random.default_rng(9)
    pasts = [rng.standard_normal((2, 1, heads, length + i + room, d_k), dtype=np.float32) for i in range(count)]
    return [StepCache.of(*past, length + i) for i, past in enumerate(pasts)]


def test_steps_over_long_pasts_share_a_run_of_the_grouped_graph_each_over_its_own_buffers(session):
    caches = long_pasts(4)
    steps = [(rows(1, 20 + i), cache) for i, cache in enumerate(caches)]
    answers, runs = run_at_once(session, steps)
    assert runs == [4]
    assert_equal_to_alone(session, steps, answers)
    for cache, (_, _, after) in zip(caches, answers, strict=True):  # its new row written where its past lies
        assert after.key is cache.key and after.value is cache.value


def test_steps_at_far_apart_positions_share_one_run(session):
    far_apart = [grown(session, 3, 30), long_pasts(1)[0], grown(session, 60, 31), grown(session, 700, 32)]
    steps = [(rows(1, 30 + i), cache) for i, cache in enumerate(far_apart)]
    answers, runs = run_at_once(session, steps)
    assert runs == [4]
    assert_equal_to_alone(session, steps, answers)


def test_more_steps_than_the_grouped_graph_holds_share_as_few_runs_as_hold_them_none_alone(session):
    members = session.steps._members
    # A full run and the few left over, each alone, would take MIN_GROUPED_STEPS runs; two runs hold them all.
    steps = [(rows(1, 40 + i), cache) for i, cache in enumerate(long_pasts(members + MIN_GROUPED_STEPS - 1))]
    answers, runs = run_at_once(session, steps, max_rows=64)
    assert len(runs) == 2
    assert_equal_to_alone(session, steps, answers)


def test_a_folder_without_the_grouped_graph_runs_long_pasts_one_after_another(session):
    steps_alone = StepGraph(session.steps._session, SMALL_D_MODEL, SMALL_HEADS)
    steps = [Step(rows(1, 50 + i), cache) for i, cache in enumerate(long_pasts(4))]
    answers, runs = steps_alone.run_steps(steps)
    assert [run.rows for run in runs] == [1, 1, 1, 1]
    for step, (output, _, _) in zip(steps, answers, strict=True):
        want = session.steps.run_step(
            Step(step.query, StepCache.of(step.cache.key.copy(), step.cache.value.copy(), step.cache.length))
        )
        np.testing.assert_allclose(output, want[0], rtol=0, atol=1e-6)


def test_a_step_writes_its_rows_into_the_buffers_it_read_and_leaves_the_rows_held_as_they_were(session):
    cache = grown(session, 16, 5)  # a first step's rows are its buffers, exactly
    assert (cache.length, cache.capacity) == (16, 16) and cache.nbytes == 2 * 16 * SMALL_D_MODEL * 4
    held = cache.key.copy()
    _, _, regrown = session.steps.run_step(Step(rows(1, 6), cache))  # 17 rows: buffers with room for 20
    assert regrown.key is not cache.key and (regrown.length, regrown.capacity) == (17, 20)
    np.testing.assert_array_equal(regrown.key[:, :, :16], held)
    _, weights, after = session.steps.run_step(Step(rows(2, 7), regrown))
    assert after.key is regrown.key and after.value is regrown.value and (after.length, after.capacity) == (19, 20)
    np.testing.assert_array_equal(after.key[:, :, :16], held)
    assert weights.shape == (1, SMALL_HEADS, 2, 19)  # over its own keys: the room past them is not answered


def test_a_step_whose_rows_overflow_grows_no_cache_and_writes_nothing_a_later_step_reads(session):
    cache = grown(session, 4, 8)
    before = cache.key.copy()
    huge = np.full((1, 1, SMALL_D_MODEL), 3e38, np.float32)
    _, _, after = session.steps.run_step(Step(huge, cache))
    assert after is None
    np.testing.assert_array_equal(cache.key, before)
    output, _, _ = session.steps.run_step(Step(rows(1, 9), cache))
    assert np.isfinite(output).all()


def test_a_step_whose_rows_overflow_in_a_shared_run_grows_no_cache_and_the_others_grow_as_alone(session):
    huge = np.full((1, 1, SMALL_D_MODEL), 3e38, np.float32)
    short = [grown(session, 12 + i, 100 + i) for i in range(4)]  # pasts copied side by side
    for caches in (short, long_pasts(4)):  # and the grouped graph
        steps = [(huge if i == 2 else rows(1, 110 + i), cache) for i, cache in enumerate(caches)]
        answers, runs = run_at_once(session, steps)
        assert runs == [4] and answers[2][2] is None
        fine = [0, 1, 3]
        assert_equal_to_alone(session, [steps[i] for i in fine], [answers[i] for i in fine])


def test_a_cache_kept_in_ortvalues_is_appended_where_it_lives_and_answers_as_on_the_host(session):
    """The path a GPU's cache takes (I/O binding, the rows appended on the device), run with OrtValues on the CPU."""
    import onnxruntime as ort

    host = grown(session, 6, 10)
    held = [
        ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a[:, :, :6]), "cpu", 0) for a in (host.key, host.value)
    ]
    on_device = StepCache.of(*held, 6)
    assert not on_device.on_host and on_device.capacity == 6
    query = rows(2, 11)
    output, weights, after = session.steps.run_step(Step(query, on_device))
    want_output, want_weights, want = session.steps.run_step(Step(query, host))
    np.testing.assert_allclose(output, want_output, rtol=0, atol=1e-6)
    np.testing.assert_allclose(weights, want_weights, rtol=0, atol=1e-7)
    assert after.length == after.capacity == 8
    np.testing.assert_allclose(after.key.numpy(), want.key[:, :, :8], rtol=0, atol=1e-6)


def test_steps_that_ask_for_the_output_alone_are_answered_no_weights_alone_stacked_or_grouped(session):
    short = [(rows(1, 60 + i), grown(session, 12 + i, 60 + i)) for i in range(4)]  # pasts copied side by side
    long = [(rows(1, 70 + i), cache) for i, cache in enumerate(long_pasts(4))]  # the grouped graph
    for steps in (short[:1], short, long):
        runs = [Step(query, StepCache.of(c.key.copy(), c.value.copy(), c.length), weights=False) for query, c in steps]
        answers, _ = session.steps.run_steps(runs)
        for step, (output, weights, after) in zip(runs, answers, strict=True):
            assert weights is None and after.length == step.cache.length + 1
            want = session.steps.run_step(
                Step(step.query, StepCache.of(step.cache.key.copy(), step.cache.value.copy(), step.cache.length))
            )
            np.testing.assert_allclose(output, want[0], rtol=0, atol=1e-6)


def test_cross_attention_steps_over_long_keys_share_a_run_of_the_grouped_cross_graph(session):
    cross = session.cross_steps
    caches = long_pasts(4)  # keys given earlier, too many to copy side by side
    steps = [Step(rows(1, 80 + i), cache) for i, cache in enumerate(caches)]
    answers, runs = cross.run_steps(steps)
    assert [run.rows for run in runs] == [4]
    for step, (output, weights, after) in zip(steps, answers, strict=True):
        alone = StepCache.of(step.cache.key.copy(), step.cache.value.copy(), step.cache.length)
        want_output, want_weights, want = cross.run_step(Step(step.query, alone))
        np.testing.assert_allclose(output, want_output, rtol=0, atol=1e-6)
        np.testing.assert_allclose(weights, want_weights, rtol=0, atol=1e-7)
        assert after.length == want.length == step.cache.length  # a step of queries alone adds no keys
