"""Steps of several sequences in one call of the step graph (server/sequences.py StepRuns): those that gather while
a call is in progress share the next one when they carry the same number of new rows; short pasts of comparable
length run as one padded batch, others one after another; each answer and grown cache equals its step run alone."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from mhaserve.server.sequences import StepRuns
from mhaserve.server.sequences.graph import PADDED_STEP_PAST_BYTES, StepCache
from mhaserve.server.session import AttentionSession
from tests.support import SMALL_D_MODEL, SMALL_HEADS


@pytest.fixture(scope="module")
def session(small_model_dir):
    return AttentionSession(small_model_dir, "cpu", 1)


def grown(session, length: int, seed: int):
    """A sequence's cache after a prompt of ``length`` rows."""
    prompt = np.random.default_rng(seed).standard_normal((1, length, SMALL_D_MODEL), dtype=np.float32)
    return session.steps.run_step(prompt, session.steps.empty_cache(1))[2]


def run_at_once(session, steps, max_rows=32) -> tuple[list, int]:
    """The steps sent together, as concurrent requests do; their answers and how many runs they took."""
    runs = []

    async def send():
        with ThreadPoolExecutor(1) as executor:
            step_runs = StepRuns(session.steps, executor, max_rows, on_runs=runs.append)
            return await asyncio.gather(*(step_runs.run(query, cache) for query, cache in steps))

    return asyncio.run(send()), sum(runs)


def rows(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, count, SMALL_D_MODEL), dtype=np.float32)


def assert_equal_to_alone(session, steps, answers):
    for (query, cache), (output, weights, after) in zip(steps, answers, strict=True):
        want_output, want_weights, want_cache = session.steps.run_step(query, cache)
        np.testing.assert_allclose(output, want_output, rtol=0, atol=1e-6)
        np.testing.assert_allclose(weights, want_weights, rtol=0, atol=1e-7)
        assert after.length == cache.length + query.shape[1] and after.nbytes == want_cache.nbytes
        np.testing.assert_allclose(after.key, want_cache.key, rtol=0, atol=1e-6)
        np.testing.assert_allclose(after.value, want_cache.value, rtol=0, atol=1e-6)


def test_steps_of_sequences_of_different_lengths_share_one_run_each_equal_to_its_run_alone(session):
    steps = [(rows(1, 10 + i), grown(session, length, i)) for i, length in enumerate((12, 17, 24, 20))]
    answers, runs = run_at_once(session, steps)
    assert runs == 1
    assert_equal_to_alone(session, steps, answers)


def test_steps_of_other_new_rows_or_a_far_longer_past_or_past_the_rows_limit_run_apart(session):
    short, long = grown(session, 10, 1), grown(session, 40, 2)
    # Calls of at most two rows: [0, 2], [1] (two new rows), [3, 4]; in the first, a past four times as long as
    # the other runs apart from it.
    steps = [(rows(1, 3), short), (rows(2, 4), short), (rows(1, 5), long), (rows(1, 6), grown(session, 12, 3)),
             (rows(1, 7), grown(session, 11, 4))]  # fmt: skip
    answers, runs = run_at_once(session, steps, max_rows=2)
    assert runs == 4
    assert_equal_to_alone(session, steps, answers)


def test_long_pasts_run_one_after_another_in_one_call(session):
    heads, d_k, length = SMALL_HEADS, SMALL_D_MODEL // SMALL_HEADS, 1100
    assert 2 * length * SMALL_D_MODEL * 4 > PADDED_STEP_PAST_BYTES  # each past too long to pad into a batch
    rng = np.random.default_rng(9)
    pasts = [rng.standard_normal((2, 1, heads, length + i, d_k), dtype=np.float32) for i in range(4)]
    steps = [(rows(1, 20 + i), StepCache.of(*past)) for i, past in enumerate(pasts)]
    answers, runs = run_at_once(session, steps)
    assert runs == 4
    assert_equal_to_alone(session, steps, answers)
