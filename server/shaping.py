"""Attention weights shaped per request: chosen heads, query rows and a key window, the top-k keys of each row
(or the smallest set holding a fraction p of its mass), and the weights' precision.

A request asks through its protocol ``parameters`` (``attn_heads``, ``attn_rows``, ``attn_keys``, ``attn_top_k``,
``attn_top_p``, ``attn_weights_precision``), read into a ``WeightsShaping`` by ``parameters.weights_shaping``;
``shaped_weights`` cuts each request's answer from its rows of a batched run's weights, in the
worker thread, after the run. Requests with different options share runs as any others do.

Every selection is a selection of the full weights the same request would have received. The mean over heads
is the mean over the chosen heads. Top-k orders a row's keys by weight, highest first, ties by the lower key
position; its indices are key positions in the full sequence. Top-p takes, in that order, the fewest keys
whose weights sum to at least p times the row's sum over the window; a row's unused entries (and every entry
of a fully masked row, whose weights are zeros) hold index -1 and value 0, and k is the largest set in the
answer. Asked for without either option (as a client that asks for every output the metadata lists), the two
top-k outputs come back empty, k = 0.
"""

from __future__ import annotations

import numpy as np

from mhaserve.contract.signature import (
    ATTN_ENTROPY,
    ATTN_MAX,
    ATTN_MAX_INDEX,
    ATTN_SINK,
    ATTN_TOP_K_INDICES,
    ATTN_TOP_K_VALUES,
    ATTN_WEIGHTS,
    ATTN_WEIGHTS_MEAN,
    SUMMARY_OUTPUT_NAMES,
)

from . import kernels
from .parameters import NO_SHAPING, WeightsShaping

TOP_K_OUTPUTS = (ATTN_TOP_K_VALUES, ATTN_TOP_K_INDICES)


def mean_over_heads(weights: np.ndarray) -> np.ndarray:
    """``weights.mean(axis=1)``, bit for bit: float32 as one sum and one division in place, which took half of
    ``mean``'s time at [1, 8, 512, 512]; float16 through ``mean``, which sums it in float32."""
    if weights.dtype != np.float32:
        return weights.mean(axis=1)
    total = np.add.reduce(weights, axis=1)
    np.true_divide(total, weights.shape[1], out=total)
    return total


def shaped_weights(weights: np.ndarray, outputs: tuple[str, ...], shaping: WeightsShaping) -> dict[str, np.ndarray]:
    """The weights' outputs a request asked for, from its rows ``weights`` [B, h, Lq, Lk] of a run."""
    if shaping is NO_SHAPING:  # the common case: views of the run's weights, no copy
        answer = {}
        if ATTN_WEIGHTS in outputs:
            answer[ATTN_WEIGHTS] = weights
        if ATTN_WEIGHTS_MEAN in outputs:
            answer[ATTN_WEIGHTS_MEAN] = mean_over_heads(weights)
        answer.update(_unranked(weights.shape[:-1], weights.dtype, outputs))
        answer.update(summaries(weights, outputs))
        return answer
    chosen = _chosen(weights, shaping)
    answer = _in_precision(summaries(chosen, outputs), shaping.dtype)  # of the chosen heads and rows, every key
    dtype = shaping.dtype or weights.dtype
    if shaping.keys is not None:
        chosen = chosen[..., slice(*shaping.keys)]
    if ATTN_WEIGHTS in outputs:
        answer[ATTN_WEIGHTS] = _as(chosen, dtype)
    if ATTN_WEIGHTS_MEAN in outputs:
        answer[ATTN_WEIGHTS_MEAN] = _as(mean_over_heads(chosen), dtype)
    if shaping.top_k is None and shaping.top_p is None:
        answer.update(_unranked(chosen.shape[:-1], dtype, outputs))
    elif ATTN_TOP_K_VALUES in outputs or ATTN_TOP_K_INDICES in outputs:
        if shaping.top_k is not None:
            values, indices = top_k(chosen, shaping.top_k)
        else:
            values, indices = top_p(chosen, shaping.top_p)
        if shaping.keys is not None:
            indices = np.where(indices >= 0, indices + shaping.keys[0], indices)
        if ATTN_TOP_K_VALUES in outputs:
            answer[ATTN_TOP_K_VALUES] = _as(values, dtype)
        if ATTN_TOP_K_INDICES in outputs:
            answer[ATTN_TOP_K_INDICES] = indices
    return answer


# A weight's logarithm where it is 0 (a masked key): finite, so that 0 * log contributes 0 to the entropy.
_SMALLEST_WEIGHT = np.float32(1e-30)


def summaries(weights: np.ndarray, outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The summaries of each head's query row that ``outputs`` names, over every key of ``weights`` [B, h, Lq, Lk]
    (float32, the entropy always; the weights' own datatype otherwise): the entropy of the row's weights in nats,
    its weight on the first key, its largest weight and that key's position (the lowest where several tie; -1 on a
    row that may attend no key, whose weights are zeros)."""
    asked = [name for name in SUMMARY_OUTPUT_NAMES if name in outputs]
    if not asked:
        return {}
    answer = {}
    if ATTN_ENTROPY in asked:
        p = weights.astype(np.float32, copy=False)
        logs = np.maximum(p, _SMALLEST_WEIGHT)
        np.log(logs, out=logs)
        np.multiply(logs, p, out=logs)
        answer[ATTN_ENTROPY] = np.negative(logs.sum(axis=-1))
    if ATTN_SINK in asked:
        answer[ATTN_SINK] = (
            np.ascontiguousarray(weights[..., 0]) if weights.shape[-1] else np.zeros(weights.shape[:-1], weights.dtype)
        )
    if ATTN_MAX in asked or ATTN_MAX_INDEX in asked:
        empty = weights.shape[-1] == 0
        largest = np.zeros(weights.shape[:-1], weights.dtype) if empty else weights.max(axis=-1)
        if ATTN_MAX in asked:
            answer[ATTN_MAX] = largest
        if ATTN_MAX_INDEX in asked:
            index = np.zeros(weights.shape[:-1], np.int64) if empty else weights.argmax(axis=-1).astype(np.int64)
            answer[ATTN_MAX_INDEX] = np.where(largest > 0, index, -1)
    return answer


def shaped_summaries(summarised: dict[str, np.ndarray], outputs: tuple[str, ...], shaping: WeightsShaping):
    """The summaries ``outputs`` names, of the heads and query rows ``shaping`` chose (over every key, whatever its
    key window), the sink and the largest weight in its precision: from a run's summaries [B, h, Lq] (the
    summaries graph's, or ``summaries`` of its weights)."""
    asked = {name: _chosen(summarised[name], shaping) for name in SUMMARY_OUTPUT_NAMES if name in outputs}
    return _in_precision(asked, shaping.dtype)


def _chosen(array: np.ndarray, shaping: WeightsShaping) -> np.ndarray:
    """The heads and query rows ``shaping`` chose of a run's weights [B, h, Lq, Lk] or summaries [B, h, Lq]."""
    if shaping.heads is not None:
        array = array[:, list(shaping.heads)]
    return array if shaping.rows is None else array[:, :, slice(*shaping.rows)]


def _in_precision(summarised: dict[str, np.ndarray], dtype) -> dict[str, np.ndarray]:
    """The sink and the largest weight in the weights' precision asked (None: as computed)."""
    return {name: _as(summary, dtype) if dtype and name in (ATTN_SINK, ATTN_MAX) else summary
            for name, summary in summarised.items()}  # fmt: skip


def _unranked(rows: tuple[int, ...], dtype: np.dtype, outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The top-k outputs of a request that asked for them without attn_top_k or attn_top_p (as clients that ask
    for every output the metadata lists do): no key ranked, k = 0."""
    dtypes = {ATTN_TOP_K_VALUES: dtype, ATTN_TOP_K_INDICES: np.int64}
    return {name: np.zeros((*rows, 0), dtypes[name]) for name in outputs if name in dtypes}


def top_k(weights: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest weights of each row (last axis) and their positions, highest first, ties by the lower
    position (ONNX Runtime's TopK; numpy would sort or partition row by row at several times the cost)."""
    values, positions = kernels.top_k(weights, k)
    return values.astype(weights.dtype, copy=False), positions


# Top-p ranks a row's first keys only, then the whole row where those do not hold p of its mass: attention rows are
# mostly peaked, and a full sort of every row costs several times the model run; ranking ever more keys at a time
# until p is reached costs more than one full rank on flat rows, which need every key (BENCHMARKS.md, "Attention
# weights shaped per request").
FIRST_RANKED = 32
# The most a top-p request's ranking holds at once, per (row, key) of its selection: the ranked values (float32),
# their positions (int64) and their running sum (float64), and the answer's padded copies of the first two.
TOP_P_BYTES_PER_KEY = 4 + 8 + 8 + 4 + 8


def top_p(weights: np.ndarray, p: float) -> tuple[np.ndarray, np.ndarray]:
    """Each row's fewest keys, in top-k order, whose weights sum to at least ``p`` of the row's sum; padded to
    the largest such set with index -1 and value 0 (a row summing to zero holds none)."""
    length = weights.shape[-1]
    flat = weights.reshape(-1, length)
    # The row's sum, less a relative 1e-12: summed in another order, the ranked keys may fall short of it by
    # a rounding step, and p = 1 must still be reached at the last key that carries weight.
    target = p * flat.sum(axis=1, dtype=np.float64) * (1 - 1e-12)
    counts = np.zeros(len(flat), np.int64)
    pending = np.flatnonzero(target > 0)  # a row with no weight holds no key
    k = min(FIRST_RANKED, length)
    values = np.zeros((len(flat), k), weights.dtype)
    positions = np.zeros((len(flat), k), np.int64)
    if pending.size:
        ranked, where = top_k(flat[pending], k)
        running = np.cumsum(ranked, axis=1, dtype=np.float64)
        reached = (running[:, -1] >= target[pending]) | (k == length)
        done = pending[reached]
        counts[done] = np.argmax(running[reached] >= target[done, None], axis=1) + 1
        values[done], positions[done] = ranked[reached], where[reached]
        pending = pending[~reached]
    if pending.size:  # the rest ranked whole: a stable sort of the negated weights puts ties at the lower key
        order = np.argsort(-flat[pending], axis=1, kind="stable")
        ranked = np.take_along_axis(flat[pending], order, axis=1)
        running = np.cumsum(ranked, axis=1, dtype=np.float64)
        counts[pending] = np.argmax(running >= target[pending, None], axis=1) + 1
        largest = int(counts[pending].max())
        values = np.pad(values, ((0, 0), (0, max(0, largest - k))))
        positions = np.pad(positions, ((0, 0), (0, max(0, largest - k))))
        values[pending, :largest], positions[pending, :largest] = ranked[:, :largest], order[:, :largest]
    largest = int(counts.max(initial=0))
    used = np.arange(largest) < counts[:, None]
    values = np.where(used, values[:, :largest], 0).astype(weights.dtype)
    positions = np.where(used, positions[:, :largest], -1)
    shape = (*weights.shape[:-1], largest)
    return values.reshape(shape), positions.reshape(shape)


def _as(weights: np.ndarray, dtype: np.dtype) -> np.ndarray:
    if weights.dtype == dtype:
        return weights
    if dtype == np.float16:
        return kernels.to_float16(weights)  # numpy converts element by element, ten times slower
    return weights.astype(dtype)


def weights_answer_bytes(shaping: WeightsShaping, outputs, batch, num_heads, q_len, kv_len, itemsize) -> int:
    """The bytes of the weights' outputs a request gets (top-p counted at its largest, the whole window)."""
    b, h, lq, lk = shaping.selected_shape(batch, num_heads, q_len, kv_len)
    if shaping.dtype is not None:
        itemsize = shaping.dtype.itemsize
    total = 0
    if ATTN_WEIGHTS in outputs:
        total += itemsize * b * h * lq * lk
    if ATTN_WEIGHTS_MEAN in outputs:
        total += itemsize * b * lq * lk
    k = shaping.top_k if shaping.top_k is not None else lk
    if ATTN_TOP_K_VALUES in outputs:
        total += itemsize * b * h * lq * k
    if ATTN_TOP_K_INDICES in outputs:
        total += 8 * b * h * lq * k
    return total


def ranking_bytes(shaping: WeightsShaping, batch, num_heads, q_len, kv_len) -> int:
    """The most ranking the request's weights holds at once, in the worker after its run: top-p at its worst, a
    flat row ranked whole (TOP_P_BYTES_PER_KEY); top-k's k values and positions."""
    b, h, lq, lk = shaping.selected_shape(batch, num_heads, q_len, kv_len)
    if shaping.top_p is not None:
        return TOP_P_BYTES_PER_KEY * b * h * lq * lk
    if shaping.top_k is not None:
        return (4 + 8) * b * h * lq * shaping.top_k
    return 0
