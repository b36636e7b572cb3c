"""How a sequence's keys and values are kept for the step graph (export/step.py), which export validates and the
server does: in buffers with room past the rows they hold, each step's new rows written in place after them, and
steps of several sequences run as one batch, each sequence's rows first in its batch rows and ``past_lengths``
saying how many are its own. Torch-free."""

from __future__ import annotations

import math
import mmap

import numpy as np

from .signature import QUERY

PAST_KEY, PAST_VALUE = "past_key", "past_value"  # the step graph's inputs: the buffers of the keys and values kept
PAST_LENGTHS = "past_lengths"  # the step graph's input: how many of the past rows are each batch row's own
NEW_KEY, NEW_VALUE = "new_key", "new_value"  # the step graph's outputs: the new rows' projected keys and values
# The grouped step graph's members: steps of this many sequences run as one call, each over its own buffers; 32 for a
# model whose projections' weights a run reads from memory rather than the CPU's cache (measured when it
# was chosen).
STEPS_GROUPED, STEPS_GROUPED_WIDE = 8, 32
WIDE_PROJECTIONS_BYTES = 16 << 20  # d_model 1,024 and wider


def weights_from_memory(d_model: int) -> bool:
    """Whether a run of the model reads its four projections' weights from memory, not the CPU's cache: its steps
    gain from sharing a run, two already."""
    return 4 * d_model * d_model * np.dtype(np.float32).itemsize >= WIDE_PROJECTIONS_BYTES


def steps_grouped(d_model: int) -> int:
    """How many members the grouped step graph of a model this wide has."""
    return STEPS_GROUPED_WIDE if weights_from_memory(d_model) else STEPS_GROUPED


def member(name: str, i: int) -> str:
    """The grouped step graph's input or output ``name`` of its i-th sequence (``query_0``, ``attn_weights_3``)."""
    return f"{name}_{i}"


def grouped_members(input_names) -> int:
    """How many members a grouped step graph with these input names has (one ``query_i`` each)."""
    return sum(name.startswith(member(QUERY, "")) for name in input_names)


def grouped_feed(feeds: list[dict[str, np.ndarray]], members: int) -> dict[str, np.ndarray]:
    """One run of a grouped step graph: each step's inputs (as the step graph takes them; each the same number of
    query rows, and of key rows for cross-attention) as its member's, the members after them of batch 0, which take
    no part."""
    empty = {name: np.zeros((0, *array.shape[1:]), array.dtype) for name, array in feeds[0].items()}
    members_feeds = [feeds[i] if i < len(feeds) else empty for i in range(members)]
    return {member(name, i): array for i, feed in enumerate(members_feeds) for name, array in feed.items()}


# A buffer that fills is replaced by one with room for this many times the rows it must hold (at least MIN_ROOM):
# its steps write their own rows plus, on average, eight times as many copied at a regrowth, at any position.
GROWTH = 1.125
MIN_ROOM = 16
# Buffers from this size are pages of their own (an anonymous mapping), not the heap's: the room past a sequence's
# rows takes no memory until rows are written there, and a buffer let go (replaced, or its sequence ended) is given
# back to the system at once, where the server's heap would keep it (its trim threshold is raised for answers).
MAPPED_FROM_BYTES = 256 << 10


def with_rows(buffer: np.ndarray, length: int, rows: np.ndarray, own_rows: bool = False) -> np.ndarray:
    """The buffer [B, h, C, d_k] holding ``rows`` [B, h, n, d_k] after its first ``length`` rows: ``buffer``
    itself, written in place, where it has room; else a new one with room to grow, the first ``length`` copied.
    Rows past ``length + n`` are zeros or rows of steps never answered: finite, and masked. A first step's rows
    that are an array of their own (not a part of a batch's) and too small to be mapped are its buffer as they
    are: no copy, no room until it grows."""
    needed = length + rows.shape[2]
    if length == 0 and own_rows and needed > buffer.shape[2] and rows.nbytes < MAPPED_FROM_BYTES:
        return rows
    if needed > buffer.shape[2]:
        room = max(math.ceil(needed * GROWTH), MIN_ROOM)
        grown = zeroed((*buffer.shape[:2], room, buffer.shape[3]), buffer.dtype)
        grown[:, :, :length] = buffer[:, :, :length]
        buffer = grown
    buffer[:, :, length:needed] = rows
    return buffer


def zeroed(shape: tuple[int, ...], dtype) -> np.ndarray:
    """np.zeros, on pages of its own from MAPPED_FROM_BYTES (unmapped when the array is let go)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    if nbytes < MAPPED_FROM_BYTES:
        return np.zeros(shape, dtype)
    pages = mmap.mmap(-1, nbytes)  # anonymous pages read as zeros
    # Base pages only: where the kernel backs memory with huge pages by default (transparent_hugepage=always),
    # a row written in the room would fault in 2 MiB of it.
    pages.madvise(mmap.MADV_NOHUGEPAGE)
    return np.frombuffer(pages, dtype).reshape(shape)


def stacked_pasts(pasts: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Buffers [B_i, h, C_i, d_k] holding L_i rows each as one [sum B_i, h, max L_i, d_k] array, each sequence's
    rows first in its batch rows, and past_lengths: steps of several sequences in one run (their rows copied)."""
    longest = max(length for _, length in pasts)
    _, heads, _, d_k = pasts[0][0].shape
    stacked = np.zeros((sum(buffer.shape[0] for buffer, _ in pasts), heads, longest, d_k), np.float32)
    lengths = np.empty(stacked.shape[0], np.int64)
    row = 0
    for buffer, length in pasts:
        rows = slice(row, row + buffer.shape[0])
        stacked[rows, :, :length] = buffer[:, :, :length]
        lengths[rows] = length
        row += buffer.shape[0]
    return stacked, lengths


def own_weights(weights: np.ndarray, first: int, batch: int, length: int, capacity: int) -> np.ndarray:
    """A sequence's part of a step's attn_weights [B, h, n, C + n]: its batch rows, over its own keys (its first
    ``length`` past columns, then the n new ones). A view where the past fills the run's C columns."""
    rows = weights[first : first + batch]
    if length == capacity:
        return rows
    return np.concatenate((rows[..., :length], rows[..., capacity:]), axis=-1)
