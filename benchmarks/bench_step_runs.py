"""Steps of several sequences in one call of the step graph, in process: AttentionSession.run_steps (one padded run
where the pasts are short, else one run after another) against one run_step call per step, at pasts of 32, 128 and 256
rows, 4 and 16 sequences, the embedded default model (512/8). Median of 30 calls each.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_step_runs.py

Not a test: BENCHMARKS.md records the figures with this command.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.sequences import Step
from mhaserve.server.session import AttentionSession


def median_ms(call, calls: int = 30) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def main() -> None:
    session = AttentionSession(ensure_default_model(), "cpu")
    rng = np.random.default_rng(0)

    def grown(length: int):
        prompt = rng.standard_normal((1, length, 512), dtype=np.float32)
        return session.steps.run_step(Step(prompt, session.steps.empty_cache(1)))[2]

    for past in (32, 128, 256):
        for sequences in (4, 16):
            steps = [
                Step(rng.standard_normal((1, 1, 512), dtype=np.float32), grown(past + i)) for i in range(sequences)
            ]
            together = median_ms(lambda steps=steps: session.steps.run_steps(steps))
            alone = median_ms(lambda steps=steps: [session.steps.run_step(step) for step in steps])
            runs = session.steps.run_steps(steps)[1]
            print(f"pasts ~{past:4d} rows, {sequences:2d} sequences: one call {together:7.3f} ms ({runs} runs), "
                  f"a call each {alone:7.3f} ms, ratio {together / alone:5.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
