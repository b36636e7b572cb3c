"""What one model run costs, by its shape: fitted on this model on this machine, for the batcher to plan runs.

A run of ``rows`` batch rows padded to ``Lq`` queries and ``Lk`` keys costs about

    overhead + per_token * rows * (Lq + Lk) + per_pair * rows * Lq * Lk

CPU seconds: a fixed price per run, the projections (linear in the tokens) and the attention itself (the
scores, softmax and weighted sum: one term per query-key pair). The three prices are measured at warm-up
on the served session, so the plan follows the machine and the model's width rather than a constant
tuned to one box.

CPU time, not wall time, because under load the cores are what runs compete for, and a run costs more
CPU than its wall time shows: ONNX Runtime's threads spin for a while after each run, waiting for the
next. In wall time the fixed price fits as about zero, and a plan on it splits a queue of mixed lengths
into many small runs that serve fewer requests per second than one padded run (BENCHMARKS.md,
"Batching across lengths").
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import onnxruntime as ort

from mhaserve.contract.cpu import cpu_signature

from .cores import usable_cores

log = logging.getLogger("mhaserve.server")

# (rows, Lq, Lk) of the runs timed at warm-up, lengths capped at the served limits. Self-attention alone ties
# the token and pair counts together (pairs = L x tokens / 2), so noise traded one price for the other (0 to
# 157 ns per pair from one start to the next); shapes with few queries and many keys, and the reverse, tell
# them apart.
FIT_SHAPES = (
    (1, 1, 1), (1, 8, 8), (1, 32, 32), (1, 96, 96), (1, 192, 192), (4, 16, 16), (4, 64, 64), (8, 32, 32),
    (2, 128, 128), (16, 16, 16), (1, 4, 384), (1, 384, 4), (4, 8, 128), (4, 128, 8), (1, 256, 32),
)  # fmt: skip
FIT_REPEATS = 6
FIT_PASSES = 3  # the fastest pass: a shared machine only adds time, and the median moved with it
# Between runs under load the event loop takes its turn (receiving, answering); ONNX Runtime's threads
# spin meanwhile. Each timed run is followed by a gap of about that length, so its price includes them.
GAP_BETWEEN_RUNS_S = 0.0005


# The largest run made on the event loop for a lone request (batcher.QUIET_BEFORE_RUN_HERE_NS), in multiply-adds:
# [1,32,512] or [1,16,768] self-attention (a [1,32,512] run took 0.39 ms on two cores here, [1,16,512] 0.21 ms,
# [1,64,512] 1.04 ms), so that the loop is held no longer than a few small requests' reading and answering take.
RUN_HERE_MAX_MULTIPLY_ADDS = 40_000_000


def multiply_adds(rows: int, q_len: int, kv_len: int, d_model: int) -> int:
    """A run's multiply-adds: the four projections (queries and output over Lq rows, keys and values over Lk) and
    the attention's two products."""
    return rows * d_model * (2 * (q_len + kv_len) * d_model + 2 * q_len * kv_len)


def fit_shapes(max_rows: int, max_q_len: int, max_kv_len: int) -> list[tuple[int, int, int]]:
    """The (rows, Lq, Lk) a fit times: FIT_SHAPES within the served limits."""
    return sorted({(min(r, max_rows), min(lq, max_q_len), min(lk, max_kv_len)) for r, lq, lk in FIT_SHAPES})


@dataclass(frozen=True)
class RunCost:
    overhead_s: float
    per_token_s: float
    per_pair_s: float

    def seconds(self, rows: int, q_len: int, kv_len: int) -> float:
        return self.overhead_s + self.per_token_s * rows * (q_len + kv_len) + self.per_pair_s * rows * q_len * kv_len

    def padded_run_seconds(self, shapes: list[tuple[int, int, int]]) -> float:
        """One run of requests of (rows, Lq, Lk), padded to the longest of each: what a run of a plan costs."""
        return self.seconds(
            sum(r for r, _, _ in shapes), max(lq for _, lq, _ in shapes), max(lk for _, _, lk in shapes)
        )

    @classmethod
    def fit(cls, run: Callable[[int, int, int], None], shapes: list[tuple[int, int, int]]) -> RunCost:
        """The process's CPU time per ``run(rows, q_len, kv_len)`` at ``shapes`` (fit_shapes), each run followed by
        GAP_BETWEEN_RUNS_S, and the three prices fitted to it (call it with the process otherwise idle)."""
        features, seconds = [], []
        for rows, q_len, kv_len in shapes:
            run(rows, q_len, kv_len)  # the first run at a shape pays for ONNX Runtime's set-up, not the shape
            passes = []
            for _ in range(FIT_PASSES):
                started = time.process_time()
                for _ in range(FIT_REPEATS):
                    run(rows, q_len, kv_len)
                    time.sleep(GAP_BETWEEN_RUNS_S)
                passes.append((time.process_time() - started) / FIT_REPEATS)
            features.append((1.0, rows * (q_len + kv_len), rows * q_len * kv_len))
            seconds.append(min(passes))
        return cls.from_samples(np.array(features), np.array(seconds))

    @classmethod
    def from_samples(cls, features: np.ndarray, seconds: np.ndarray) -> RunCost:
        """Least squares of the relative error, with every price at least zero (a negative one would be noise, not
        a saving). Relative, not absolute: the large shapes' noise (milliseconds) swamped the fixed price (about
        one), which came out anywhere from 0 to 4.7 ms from one fit to the next on one machine, and at 0 every
        length became a run of its own; weighted by 1/seconds, 0.96-1.35 ms (BENCHMARKS.md, "A server's start")."""
        weights = 1.0 / np.maximum(seconds, seconds.max() * 1e-3)
        features, seconds = features * weights[:, None], seconds * weights
        active = [0, 1, 2]
        while True:
            solution, *_ = np.linalg.lstsq(features[:, active], seconds, rcond=None)
            if (solution >= 0).all() or len(active) == 1:
                break
            del active[int(np.argmin(solution))]
        prices = [0.0, 0.0, 0.0]
        for index, price in zip(active, solution, strict=True):
            prices[index] = max(0.0, float(price))
        return cls(*prices)


PRICES = tuple(f.name for f in fields(RunCost))


def plan_runs(shapes: list[tuple[int, int, int]], cost: RunCost, max_rows: int | None = None) -> list[list[int]]:
    """Split requests of (rows, Lq, Lk) into runs of at most ``max_rows`` rows whose summed estimated cost
    is least; shortest lengths first.

    Requests sorted by length, each run a contiguous stretch of that order (one padded to its longest
    member); a dynamic programme over the cut points finds the cheapest split. Equal lengths cost most
    in one run only if the per-run overhead were negative, so they stay together up to ``max_rows``.
    Returns lists of indices into ``shapes``.
    """
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i][1], shapes[i][2]))
    best = [0.0] + [float("inf")] * len(order)
    start_of = [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        rows = q_len = kv_len = 0
        for start in range(end - 1, -1, -1):
            r, lq, lk = shapes[order[start]]
            rows, q_len, kv_len = rows + r, max(q_len, lq), max(kv_len, lk)
            if max_rows is not None and rows > max_rows and start < end - 1:
                break  # no longer one run (a single request over the limit still runs alone)
            total = best[start] + cost.seconds(rows, q_len, kv_len)
            if total < best[end]:
                best[end], start_of[end] = total, start
    runs, end = [], len(order)  # from the last cut back
    while end > 0:
        start = start_of[end]
        runs.append(order[start:end])
        end = start
    return runs[::-1]


class FittedCosts:
    """Run costs fitted at earlier starts, a JSON file each in ``folder`` (None: none kept), named by a digest of
    everything the fit depends on: what the caller names (the graph, the shapes timed, the session's threads) and
    what this module adds (the fit's own constants, ONNX Runtime's version, this machine's CPU and the cores the
    process may use). A later start of the same (a restart, another worker, each of a tune's candidates) reads the
    prices rather than spending seconds on the fit again: 285 timed runs, 2.9 s of a 4.6 s start of the default
    model on two cores (BENCHMARKS.md, "A server's start"). What cannot be read or written is fitted, or
    fitted again, as if there were no file."""

    def __init__(self, folder: Path | None):
        self.folder = folder

    def key(self, **facts) -> str:
        facts |= {
            "fit": [FIT_SHAPES, FIT_REPEATS, FIT_PASSES, GAP_BETWEEN_RUNS_S],
            "onnxruntime": ort.__version__,
            "cpu": cpu_signature(),
            "cores": usable_cores(),
        }
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:32]

    def get(self, key: str) -> tuple[RunCost, str] | None:
        """The prices fitted under ``key`` and when (ISO 8601), or None."""
        if self.folder is None:
            return None
        try:
            saved = json.loads((self.folder / f"{key}.json").read_text())
            prices = [float(saved[name]) for name in PRICES]
            fitted_at = str(saved["fitted_at"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if not all(math.isfinite(price) and price >= 0 for price in prices):  # a fit never writes such a price
            return None
        return RunCost(*prices), fitted_at

    def put(self, key: str, cost: RunCost) -> None:
        if self.folder is None:
            return
        path = self.folder / f"{key}.json"
        saved = {name: getattr(cost, name) for name in PRICES}
        saved["fitted_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        written = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            # Written whole, then renamed: workers starting at once each fit and write, and none reads a part.
            with tempfile.NamedTemporaryFile("w", dir=self.folder, suffix=".tmp", delete=False) as file:
                written = Path(file.name)
                json.dump(saved, file)
            os.replace(written, path)
        except OSError as error:
            log.info("run cost model not kept for later starts (%s): the next start fits it again", error)
            if written is not None:
                written.unlink(missing_ok=True)
