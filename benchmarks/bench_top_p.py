"""Top-p in process: the served form (the first 32 keys, then the rest of a row ranked whole) against ranking
twice as many keys at a time until p is reached (the form before), side by side in alternating rounds, on
[1, 8, 512, 512] weights: flat rows (every key needed), random rows and peaked rows (a softmax of scaled scores).

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_top_p.py [--rounds 5]

Both answer the same (checked here); it prints each one's median ms and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mhaserve.server import shaping


def doubling_top_p(weights: np.ndarray, p: float):
    """The form before: top-k of 32, 64, 128, ... keys until each row holds p of its mass."""
    length = weights.shape[-1]
    flat = weights.reshape(-1, length)
    target = p * flat.sum(axis=1, dtype=np.float64) * (1 - 1e-12)
    counts = np.zeros(len(flat), np.int64)
    values = np.zeros((len(flat), 0), weights.dtype)
    positions = np.zeros((len(flat), 0), np.int64)
    pending = np.flatnonzero(target > 0)
    k = min(shaping.FIRST_RANKED, length)
    while pending.size:
        ranked, where = shaping.top_k(flat[pending], k)
        running = np.cumsum(ranked, axis=1, dtype=np.float64)
        reached = running[:, -1] >= target[pending]
        if k == length:
            reached[:] = True
        done = pending[reached]
        counts[done] = np.argmax(running[reached] >= target[done, None], axis=1) + 1
        if values.shape[1] < k:
            values = np.pad(values, ((0, 0), (0, k - values.shape[1])))
            positions = np.pad(positions, ((0, 0), (0, k - positions.shape[1])))
        values[done], positions[done] = ranked[reached], where[reached]
        pending = pending[~reached]
        k = min(2 * k, length)
    largest = int(counts.max(initial=0))
    used = np.arange(largest) < counts[:, None]
    values = np.where(used, values[:, :largest], 0).astype(weights.dtype)
    positions = np.where(used, positions[:, :largest], -1)
    shape = (*weights.shape[:-1], largest)
    return values.reshape(shape), positions.reshape(shape)


def rows(kind: str) -> np.ndarray:
    rng = np.random.default_rng(0)
    shape = (1, 8, 512, 512)
    if kind == "flat":
        return np.full(shape, 1 / 512, np.float32)
    scores = rng.standard_normal(shape) * (1.0 if kind == "random" else 4.0)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(f"{'rows':>8} {'p':>5} | {'served ms':>9} {'before ms':>9} | before / served")
    for kind in ("flat", "random", "peaked"):
        weights = rows(kind)
        for p in (0.9, 1.0):
            served, before = shaping.top_p(weights, p), doubling_top_p(weights, p)
            assert all(np.array_equal(a, b) for a, b in zip(served, before, strict=True))
            times = {"served": [], "before": []}
            for _ in range(args.rounds):
                for name, function in (("served", shaping.top_p), ("before", doubling_top_p)):
                    started = time.perf_counter()
                    function(weights, p)
                    times[name].append((time.perf_counter() - started) * 1000)
            a, b = statistics.median(times["served"]), statistics.median(times["before"])
            print(f"{kind:>8} {p:>5} | {a:9.1f} {b:9.1f} | {b / a:5.2f}")


if __name__ == "__main__":
    main()
