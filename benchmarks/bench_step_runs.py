"""Steps of several sequences in one call of the step graph, in process: StepGraph.run_steps (one run, the pasts
copied side by side, where they are short, else runs of the grouped step graph, each over its own buffers) against
one run_step call per step, at pasts of 32, 128, 256 and 1,024 rows, 4, 16 and 64 sequences, the embedded default
model (512/8) or ``--model-dir``'s; each sequence's buffers with room, as between regrowths. Median of 30 calls each
(10 with ``--model-dir``).

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_step_runs.py [--stack-up-to ROWS] [--few]
        [--model-dir DIR --pasts 256 --sequences 32] [--members 8,16,32] [--cross]

``--stack-up-to`` runs steps as one batch up to pasts of that many rows (the server's bound is 128 at 512/8), to
see where copying the pasts side by side stops paying; ``--stack-up-to 0`` runs every group in the grouped graph.
``--few``: then two and three steps at pasts of 256 and 1,024 rows, in one run of the grouped graph (its other
members empty) against a run each: where a group is too small to share a run. ``--members``: then 32 steps at
pasts of 256 rows in runs of grouped graphs of those many members, built from the folder's weights (needs the
export extra). ``--cross``: cross-attention sequences (the keys given with a first step), their steps queries
alone (the first table only).

Not a test: BENCHMARKS.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.graphs import AttentionGraphs
from mhaserve.server.sequences import Step, graph
from mhaserve.server.sequences.graph import StepCache, StepGraph
from mhaserve.server.sequences.runtime import open_step_graphs
from mhaserve.server.session import session_options

CPU = "CPUExecutionProvider"


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
    parser.add_argument("--model-dir", help="a model folder (default: the embedded default model)")
    parser.add_argument("--pasts", default="32,128,256,1024", help="rows of past, comma-separated")
    parser.add_argument("--sequences", default="4,16,64", help="sequences stepping, comma-separated")
    parser.add_argument("--few", action="store_true", help="then 2 and 3 steps grouped against a run each")
    parser.add_argument("--members", help="then grouped graphs of these many members, comma-separated")
    parser.add_argument("--cross", action="store_true", help="cross-attention sequences: pasts of keys given once")
    args = parser.parse_args()
    folder = Path(args.model_dir) if args.model_dir else ensure_default_model()
    session = AttentionGraphs.open(folder, "cpu")
    self_graph, cross_graph = open_step_graphs(session)
    d, heads = session.info.d_model, session.info.num_heads
    calls = 10 if args.model_dir else 30
    if args.stack_up_to is not None:
        graph.STACKED_STEP_PAST_BYTES = 2 * args.stack_up_to * d * 4
        graph.STACKED_STEPS_BYTES = 1 << 40
    rng = np.random.default_rng(0)

    steps_graph = cross_graph if args.cross else self_graph

    def grown(length: int) -> StepCache:
        """A sequence's cache at ``length`` rows, its buffers with room (a prompt, then a one-row step; or, with
        --cross, keys given with a first step and a one-key step)."""
        prompt = rng.standard_normal((1, length, d), dtype=np.float32)
        if args.cross:
            first = Step(prompt[:, :1], cross_graph.empty_cache(1), prompt[:, :-1], prompt[:, :-1])
            cache = cross_graph.run_step(first)[2]
            return cross_graph.run_step(Step(prompt[:, :1], cache, prompt[:, -1:], prompt[:, -1:]))[2]
        cache = self_graph.run_step(Step(prompt[:, :-1], self_graph.empty_cache(1)))[2]
        return self_graph.run_step(Step(prompt[:, -1:], cache))[2]

    def steps_at(past: int, count: int) -> list[Step]:
        return [Step(rng.standard_normal((1, 1, d), dtype=np.float32), grown(past + i)) for i in range(count)]

    print(f"{d}/{heads}, {folder}{', cross-attention' if args.cross else ''}:")
    for past in (int(p) for p in args.pasts.split(",")):
        for sequences in (int(s) for s in args.sequences.split(",")):
            steps = steps_at(past, sequences)
            together = median_ms(lambda steps=steps: steps_graph.run_steps(steps), calls)
            alone = median_ms(lambda steps=steps: [steps_graph.run_step(step) for step in steps], calls)
            runs = len(steps_graph.run_steps(steps)[1])
            print(f"pasts ~{past:4d} rows, {sequences:2d} sequences: one call {together:7.3f} ms ({runs} runs), "
                  f"a call each {alone:7.3f} ms, ratio {together / alone:5.2f}")  # fmt: skip
    if args.few:
        graph.STACKED_STEP_PAST_BYTES, self_graph._min_grouped = 0, 2  # every group of two or more: grouped
        for past in (256, 1024):
            for count in (2, 3):
                steps = steps_at(past, count)
                grouped = median_ms(lambda steps=steps: self_graph.run_steps(steps), calls)
                alone = median_ms(lambda steps=steps: [self_graph.run_step(step) for step in steps], calls)
                print(f"pasts ~{past:4d} rows, {count} steps: one grouped run {grouped:7.3f} ms, a run each "
                      f"{alone:7.3f} ms, ratio {grouped / alone:5.2f}")  # fmt: skip
    if args.members:
        import onnxruntime as ort

        from mhaserve.export.step import grouped_step_graph
        from mhaserve.model.weights import load_weights

        module = load_weights(folder / "weights.pt")
        steps = steps_at(256, 32)
        for members in (int(m) for m in args.members.split(",")):
            built = grouped_step_graph(module, members).SerializeToString()
            grouped = ort.InferenceSession(built, session_options(session.intra_op_threads, 1, -1.0), providers=[CPU])
            steps_graph = StepGraph(self_graph._session, d, heads, grouped)
            took = median_ms(lambda steps_graph=steps_graph: steps_graph.run_steps(steps), calls)
            print(f"32 steps at pasts ~256 rows in runs of {members:2d} members: {took:7.3f} ms "
                  f"({took / 32:6.3f} ms a step)")  # fmt: skip
            del grouped, steps_graph


if __name__ == "__main__":
    main()
