"""How steps of several sequences share one run of the step graph (export/step.py), which export validates and the
server does: each sequence's past keys and values right-aligned in one batch, padding on the left, and
``past_lengths`` saying how many rows of it are each batch row's own. Torch-free."""

from __future__ import annotations

import numpy as np

PAST_LENGTHS = "past_lengths"  # the step graph's input: how many of the padded past rows are each batch row's own


def padded_pasts(pasts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """[B_i, h, P_i, d_k] arrays as one [sum B_i, h, max P_i, d_k] array, each right-aligned, and past_lengths."""
    longest = max(past.shape[2] for past in pasts)
    batch, heads, _, d_k = pasts[0].shape
    padded = np.zeros((sum(p.shape[0] for p in pasts), heads, longest, d_k), np.float32)
    lengths = np.empty(padded.shape[0], np.int64)
    row = 0
    for past in pasts:
        rows = slice(row, row + past.shape[0])
        padded[rows, :, longest - past.shape[2] :] = past
        lengths[rows] = past.shape[2]
        row += past.shape[0]
    return padded, lengths


def own_cache(present: np.ndarray, first: int, batch: int, past: int, longest: int) -> np.ndarray:
    """A sequence's part of a batched step's present_key or present_value [B, h, longest + n, d_k]: its batch rows
    and its own rows, the last past + n."""
    return present[first : first + batch, :, longest - past :]


def own_weights(weights: np.ndarray, first: int, batch: int, past: int, longest: int) -> np.ndarray:
    """A sequence's part of a batched step's attn_weights [B, h, n, longest + n]: its batch rows, over its own keys,
    the last past + n."""
    return weights[first : first + batch, :, :, longest - past :]
