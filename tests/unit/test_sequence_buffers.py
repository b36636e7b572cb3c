"""A sequence's key and value buffers (contract/steps.py): each step's rows written in place after the rows held,
a full buffer replaced by one an eighth larger; from MAPPED_FROM_BYTES pages of their own, so that the room past a
sequence's rows takes no memory until written there and a buffer let go leaves the process at once (the server's
heap keeps what it frees)."""

from __future__ import annotations

import gc
import math

import numpy as np

from mhaserve.contract.steps import GROWTH, MAPPED_FROM_BYTES, MIN_ROOM, with_rows, zeroed

HEADS, D_K = 8, 64


def rows(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, HEADS, count, D_K), dtype=np.float32)


def rss_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def test_steps_are_written_in_place_and_a_full_buffer_grows_by_an_eighth():
    empty = np.zeros((1, HEADS, 0, D_K), np.float32)
    first = rows(3, seed=1)
    buffer = with_rows(empty, 0, first, own_rows=True)
    assert buffer is first  # a small first step's rows are its buffer, uncopied
    grown = with_rows(buffer, 3, rows(2, seed=2))
    assert grown.shape[2] == MIN_ROOM and np.array_equal(grown[:, :, :3], first)
    assert with_rows(grown, 5, rows(1, seed=3)) is grown  # room left: written in place
    full = with_rows(grown, 6, rows(MIN_ROOM - 6, seed=4))
    assert full is grown and with_rows(full, MIN_ROOM, rows(1)).shape[2] == math.ceil((MIN_ROOM + 1) * GROWTH)


def test_a_large_first_step_is_copied_into_pages_with_room():
    large = rows(MAPPED_FROM_BYTES // (HEADS * D_K * 4) + 1, seed=5)
    buffer = with_rows(np.zeros((1, HEADS, 0, D_K), np.float32), 0, large, own_rows=True)
    assert buffer is not large and buffer.shape[2] == math.ceil(large.shape[2] * GROWTH)
    assert np.array_equal(buffer[:, :, : large.shape[2]], large) and not buffer[:, :, large.shape[2] :].any()


def test_mapped_buffers_take_memory_only_where_written_and_give_it_back_when_let_go():
    gc.collect()
    before = rss_mib()
    buffers = [zeroed((1, HEADS, 2048, D_K), np.float32) for _ in range(16)]  # 4 MiB each
    assert rss_mib() - before < 8, "room nothing was written to took memory"
    for buffer in buffers:
        buffer[:, :, :1024] = 1.0  # half of every head's rows
    assert 28 <= rss_mib() - before <= 40
    buffers.clear()
    gc.collect()
    assert rss_mib() - before < 8, "buffers let go were kept by the process"
