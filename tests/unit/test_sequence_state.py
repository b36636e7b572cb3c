"""The process's live sequences (server/sequences/state.py): a step looks at its own sequence only, refused once it
has been idle past its timeout even before the periodic sweep drops it; a start frees the room of every idle one."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from mhaserve.server.errors import RequestError
from mhaserve.server.memory import MemoryBudget
from mhaserve.server.parameters import SequenceParameters
from mhaserve.server.sequences.graph import StepCache
from mhaserve.server.sequences.state import Sequences


class Settings:
    """A model's sequence settings, as model_config.ModelSettings gives them."""

    def __init__(self, timeout_s: float):
        self.sequence_idle_timeout_s, self.max_sequence_length = timeout_s, 64

    def named(self, name: str) -> str:
        return f"--{name.replace('_', '-')}"


def served(timeout_s: float = 60.0):
    return SimpleNamespace(
        settings=Settings(timeout_s), signature=SimpleNamespace(name="mha"), pin=lambda: None, unpin=lambda: None
    )


def empty_cache(batch: int) -> StepCache:
    empty = np.zeros((batch, 2, 0, 4), np.float32)
    return StepCache.of(empty, empty.copy(), 0)


def live(sequences: Sequences, model, *ids):
    for sequence_id in ids:
        sequences.commit(sequences.begin(SequenceParameters(sequence_id, start=True, end=False), model, empty_cache, 1))


def test_a_step_naming_a_sequence_idle_past_its_timeout_is_refused_before_the_sweep_drops_it():
    sequences, model = Sequences(MemoryBudget(1 << 30), max_sequences=8), served(timeout_s=0.5)
    live(sequences, model, "a", "b")
    sequences.live[("", "a")].last_used -= 10  # idle for 10 s; no sweep has run
    sequences.live[("", "b")].last_used -= 10
    with pytest.raises(RequestError, match=r"'a' is not live: dropped after 0.5 s idle \(--sequence-idle-timeout-s\)"):
        sequences.begin(SequenceParameters("a", start=False, end=False), model, empty_cache, 1)
    assert sequences.timed_out_total == 1 and ("", "b") in sequences.live  # the other waits for the sweep
    sequences.drop_idle()
    assert not sequences.live and sequences.timed_out_total == 2


def test_a_start_at_the_limit_takes_the_room_of_sequences_idle_past_their_timeout():
    sequences, model = Sequences(MemoryBudget(1 << 30), max_sequences=2), served(timeout_s=0.5)
    live(sequences, model, "a", "b")
    sequences.live[("", "a")].last_used = time.monotonic() - 10
    live(sequences, model, "c")
    assert sorted(sequence_id for _, sequence_id in sequences.live) == ["b", "c"]


def test_each_clients_share_of_sequence_bytes_is_checked_as_if_summed_over_its_live_sequences():
    """A step checks its client's bytes against --max-sequence-bytes-per-client from a running count, not by summing
    every live sequence; over starts, growth, ends, restarts and timeouts it refuses exactly where the sum would."""
    import random

    share = 64 * 1024
    sequences = Sequences(MemoryBudget(1 << 30), max_sequences=64, bytes_per_client=share)
    model = served(timeout_s=60.0)
    rng = random.Random(3)

    def cache_of(rows: int) -> StepCache:
        buffer = np.zeros((1, 2, rows, 4), np.float32)
        return StepCache.of(buffer, buffer.copy(), rows)

    refused = allowed = 0
    for _ in range(600):
        caller, sequence_id = rng.choice(["ann", "bob", "cy"]), rng.randrange(6)
        key, action = (caller, sequence_id), rng.random()
        if action < 0.1 and key in sequences.live:
            sequences.end(sequences.live[key])
        elif action < 0.15 and key in sequences.live:
            sequences.live[key].last_used -= 120  # idle past its timeout: the next sweep drops it
            sequences.drop_idle()
        else:
            start = key not in sequences.live or action < 0.25  # a start again restarts it
            sequence = sequences.begin(
                SequenceParameters(sequence_id, start=start, end=False), model, empty_cache, 1, caller
            )
            grown = cache_of(sequence.length + rng.randint(1, 400))
            others = sum(s.nbytes for s in sequences.live.values() if s.caller == caller and s is not sequence)
            try:
                sequences.grow(sequence, grown)
            except RequestError as error:
                assert others + grown.nbytes > share and "--max-sequence-bytes-per-client" in error.message
                refused += 1
                continue
            assert others + grown.nbytes <= share
            allowed += 1
            if not sequence.started:
                sequences.commit(sequence)
    assert refused > 20 and allowed > 100  # both sides of the share were reached


def test_a_worker_keeps_its_anonymous_sequences_links_until_it_forgets_their_end(tmp_path, monkeypatch):
    from mhaserve.server.sequences import state
    from mhaserve.server.worker_forward import SequenceHomes

    monkeypatch.setattr(state, "REMEMBERED_ENDS", 2)
    homes = SequenceHomes(tmp_path, own=1)
    sequences, model = Sequences(MemoryBudget(1 << 30), max_sequences=8, homes=homes), served()
    live(sequences, model, "a", "b", "c")
    assert [homes.of(each) for each in "abc"] == [1, 1, 1]  # every worker finds them here
    for each in "abc":
        sequences.end(sequences.live[("", each)])
    # "a"'s end is forgotten (two remembered): a later step of it is answered by whichever worker takes it
    assert [homes.of(each) for each in "abc"] == [None, 1, 1]


def test_two_starts_of_one_id_at_once_in_two_workers_leave_it_live_in_the_later_one_only(tmp_path):
    """Both workers found no link and started the sequence; the later claim wins (every step goes there), and the
    other worker's copy is dropped at its next look, its memory returned, rather than held until the idle timeout."""
    from mhaserve.server.worker_forward import SequenceHomes

    budgets = [MemoryBudget(1 << 30), MemoryBudget(1 << 30)]
    workers = [Sequences(budget, 8, homes=SequenceHomes(tmp_path, own)) for own, budget in enumerate(budgets)]
    model = served()
    live(workers[0], model, "chat-1", "chat-2")
    live(workers[1], model, "chat-1")  # its first step answered after the first worker's
    for sequences in workers:
        sequences.drop_taken_elsewhere()
    assert list(workers[0].live) == [("", "chat-2")] and list(workers[1].live) == [("", "chat-1")]
    with pytest.raises(RequestError, match="not live: started again in another worker of this server"):
        workers[0].begin(SequenceParameters("chat-1", start=False, end=False), model, empty_cache, 1)
