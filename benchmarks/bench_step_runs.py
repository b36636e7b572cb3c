"""Steps of several sequences in one call of the step graph, in process: StepGraph.run_steps (one run, the pasts
copied side by side, where they are short, else runs of the grouped step graph, each over its own buffers) against
one run_step call per step, at pasts of 32, 128, 256 and 1,024 rows, 4, 16 and 64 sequences, the embedded default
model (512/8); each sequence's buffers with room, as between regrowths. Median of 30 calls each.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_step_runs.py [--stack-up-to ROWS]

``--stack-up-to`` runs steps as one batch up to pasts of that many rows (the server's bound is 128 at 512/8), to
see where copying the pasts side by side stops paying; ``--stack-up-to 0`` runs every group in the grouped graph.

Not a test: BENCHMARKS.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.sequences import Step, graph
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stack-up-to", type=int, help="rows of past up to which steps run as one batch")
    args = parser.parse_args()
    if args.stack_up_to is not None:
        graph.STACKED_STEP_PAST_BYTES = 2 * args.stack_up_to * 512 * 4
        graph.STACKED_STEPS_BYTES = 1 << 40
    session = AttentionSession(ensure_default_model(), "cpu")
    rng = np.random.default_rng(0)

    def grown(length: int):
        """A sequence's cache at ``length`` rows, its buffers with room (a prompt, then a one-row step)."""
        prompt = rng.standard_normal((1, length, 512), dtype=np.float32)
        cache = session.steps.run_step(Step(prompt[:, :-1], session.steps.empty_cache(1)))[2]
        return session.steps.run_step(Step(prompt[:, -1:], cache))[2]

    for past in (32, 128, 256, 1024):
        for sequences in (4, 16, 64):
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
