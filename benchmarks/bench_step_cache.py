"""A sequence's step at growing positions: the step graph of another revision (which wrote the whole grown cache as
its output every step) against the working tree's (which returns the new rows only, written in place into buffers
with room to grow), in process, on the default model's sizes (512/8) at ONNX Runtime's two intra-op threads.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_step_cache.py --baseline REV [--steps 200] [--rounds 3]

From each position (16, 512, 2,048, 4,096 rows) one-row steps are taken in a row, each over the cache the last one
left, as the server does: the cache grown by the revision's graph, or the new rows written into the buffers, which
start full, so that the window holds whole cycles of regrowth (at least ``--steps`` steps). Printed per position and
graph: ms per step (median of the rounds' means; the rounds alternate which graph goes first) and the cache bytes
written per step (the graph's grown cache, or the new rows plus the regrowths' copies). Not a test: BENCHMARKS.md
records the figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from mhaserve.contract.steps import GROWTH, MIN_ROOM, PAST_KEY, PAST_LENGTHS, PAST_VALUE, with_rows
from mhaserve.export.step import step_graph
from mhaserve.model import MultiHeadAttention

POSITIONS = (16, 512, 2048, 4096)
D_MODEL, HEADS = 512, 8
ROOT = Path(__file__).resolve().parents[1]


def revision_step_graph(revision: str):
    """export/step.py's step_graph at ``revision``, loaded beside today's modules (its validation helpers, which
    need that revision's contract, are cut off)."""
    source = subprocess.run(
        ["git", "show", f"{revision}:export/step.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    source = source[: source.index("# (batch, sequence length)")]
    source = "\n".join(
        f'PAST_LENGTHS = "{PAST_LENGTHS}"' if line.startswith("from mhaserve.contract.steps import") else line
        for line in source.splitlines()
    )
    spec = importlib.util.spec_from_loader("mhaserve.export.step_at_revision", loader=None)
    module = types.ModuleType(spec.name)
    module.__package__ = "mhaserve.export"
    exec(compile(source, f"{revision}:export/step.py", "exec"), module.__dict__)
    return module.step_graph


def session(model, threads: int = 2) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def grown_steps(run: ort.InferenceSession, cache: tuple[np.ndarray, np.ndarray], rows: np.ndarray):
    """The revision's steps: each returns the cache grown by its row."""
    key, value = cache
    written, started = 0, time.perf_counter()
    for row in rows:
        lengths = np.full(1, key.shape[2], np.int64)
        _, _, key, value = run.run(None, {"query": row, PAST_KEY: key, PAST_VALUE: value, PAST_LENGTHS: lengths})
        written += key.nbytes + value.nbytes
    return (time.perf_counter() - started) / len(rows), written / len(rows)


def in_place_steps(run: ort.InferenceSession, cache: tuple[np.ndarray, np.ndarray, int], rows: np.ndarray):
    """Today's steps: each returns its new rows, written after the cache's own."""
    key, value, length = cache
    written, started = 0, time.perf_counter()
    for row in rows:
        lengths = np.full(1, length, np.int64)
        _, _, new_key, new_value = run.run(
            None, {"query": row, PAST_KEY: key, PAST_VALUE: value, PAST_LENGTHS: lengths}
        )
        grown_key, grown_value = with_rows(key, length, new_key), with_rows(value, length, new_value)
        written += new_key.nbytes + new_value.nbytes
        if grown_key is not key:  # a regrowth copied the rows it held
            written += 2 * new_key.nbytes * length
        key, value, length = grown_key, grown_value, length + 1
    return (time.perf_counter() - started) / len(rows), written / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the revision whose step graph grew the whole cache")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = MultiHeadAttention(D_MODEL, HEADS).eval()
    grown, in_place = session(revision_step_graph(args.baseline)(module)), session(step_graph(module))
    rng = np.random.default_rng(0)
    d_k = D_MODEL // HEADS
    print(f"{'position':>8}  {'graph':<22} {'ms/step':>8} {'bytes written/step':>19}")
    for position in POSITIONS:
        past = rng.standard_normal((2, 1, HEADS, position, d_k), dtype=np.float32)
        # Full buffers, so that the first step regrows them, and whole cycles of growth (the steps that fill the
        # room a regrowth makes), at least --steps: the bytes a step writes, regrowths included, on average.
        cycle = max(math.ceil((position + 1) * GROWTH), MIN_ROOM) - position
        steps = cycle * math.ceil(args.steps / cycle)
        rows = rng.standard_normal((steps, 1, 1, D_MODEL), dtype=np.float32)
        buffers = [np.ascontiguousarray(rows_of) for rows_of in past]
        times: dict[str, list[float]] = {"grown cache (baseline)": [], "written in place": []}
        written: dict[str, float] = {}
        grown_steps(grown, (past[0], past[1]), rows[:5])  # warm-up
        in_place_steps(in_place, (buffers[0].copy(), buffers[1].copy(), position), rows[:5])
        for round_ in range(args.rounds):
            order = ["grown cache (baseline)", "written in place"][:: 1 if round_ % 2 == 0 else -1]
            for name in order:
                if name == "written in place":
                    per_step, nbytes = in_place_steps(in_place, (buffers[0].copy(), buffers[1].copy(), position), rows)
                else:
                    per_step, nbytes = grown_steps(grown, (past[0], past[1]), rows)
                times[name].append(per_step * 1000)
                written[name] = nbytes
        for name, values in times.items():
            print(f"{position:>8}  {name:<22} {statistics.median(values):>8.3f} {written[name]:>19,.0f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
