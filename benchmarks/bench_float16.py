"""Where float16 loses accuracy in the attention graph, across input scales, and what each float16 graph costs.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_float16.py [--seeds 3] [--reps 50]

Accuracy: the default 512/8 model (seed 0), exported in float32 and converted with ``to_float16`` so that one
part of the graph at a time computes in float16 (the query and key projections; the scores Q K^T / sqrt(d_k);
the masked softmax; the value projection; P V with the output projection), then everything, then the graph
``--precision fp16`` exports (what computes the weights in float32, the value path in float16). Each runs on
ONNX Runtime's CPU provider on standard normal inputs times a scale, self-attention [1, 16, 512] and
cross-attention [1, 16, 512] -> [1, 64, 512]; errors are against the module evaluated in float64, the
output's relative to its largest magnitude, the weights' absolute, the worst over the seeds.

Time: the float32 graph, the all-float16 graph and the exported float16 graph in process, median time per
call at [1, 16, 512], [1, 128, 512] and [1, 512, 512], in alternating rounds so all see the same noise.
Not a test: it prints numbers; BENCHMARKS.md records them with this command.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import numpy as np
import onnx
import torch
from bench_server import ort_session

from mhaserve.export.onnx_export import export_onnx, float16_attention, nodes_computing, to_float16
from mhaserve.model import seeded_module

SCALES = (0.01, 1, 10, 30, 100, 300, 1000, 10000)


def parts(model: onnx.ModelProto) -> dict[str, set[str]]:
    """The graph's nodes by the step of attention they compute, found from its structure."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    weights = nodes_computing(model, "attn_weights")
    scores = next(
        n for n in graph.node if n.name in weights and n.op_type == "MatMul" and not set(n.input) & initializers
    )
    projections = set().union(*(nodes_computing(model, name) for name in scores.input))
    scaled = {n.name for n in graph.node if scores.output[0] in n.input and n.op_type == "Div"}
    weighted_sum = next(n for n in graph.node if "attn_weights" in n.input and n.op_type == "MatMul")
    value = nodes_computing(model, weighted_sum.input[1])
    return {
        "Q,K projections": projections,
        "scores": {scores.name} | scaled,
        "softmax": weights - projections - {scores.name} - scaled,
        "V projection": value,
        "P.V, W_o": {n.name for n in graph.node} - weights - value,
    }


def accuracy(module, graphs: dict[str, onnx.ModelProto], seeds: int) -> None:
    exact = copy.deepcopy(module).double()
    sessions = {name: ort_session(graph.SerializeToString(), 2) for name, graph in graphs.items()}
    print(f"{'scale':>7} " + " ".join(f"{name:>22}" for name in sessions))
    print(f"{'':>7} " + " ".join(f"{'output rel  weights abs':>22}" for _ in sessions))
    for scale in SCALES:
        worst = {name: [0.0, 0.0] for name in sessions}
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            query = (rng.standard_normal((1, 16, module.d_model)) * scale).astype(np.float32)
            memory = (rng.standard_normal((1, 64, module.d_model)) * scale).astype(np.float32)
            for key in (query, memory):
                mask = np.ones((1, 1, 1, key.shape[1]), dtype=bool)
                with torch.no_grad():
                    want = [t.numpy() for t in exact(*(torch.from_numpy(a).double() for a in (query, key, key)))]
                for name, s in sessions.items():
                    out, weights = s.run(None, {"query": query, "key": key, "value": key, "mask": mask})
                    errors = (
                        np.abs(out - want[0]).max() / np.abs(want[0]).max(),
                        np.abs(weights.astype(np.float64) - want[1]).max(),
                    )
                    worst[name] = [max(a, b) for a, b in zip(worst[name], errors, strict=True)]
        print(f"{scale:>7g} " + " ".join(f"{o:>10.1e} {w:>11.1e}" for o, w in worst.values()), flush=True)


def timing(graphs: dict[str, onnx.ModelProto], d_model: int, reps: int, rounds: int, threads: int) -> None:
    sessions = {name: ort_session(graph.SerializeToString(), threads) for name, graph in graphs.items()}
    for length in (16, 128, 512):
        query = np.random.default_rng(0).standard_normal((1, length, d_model), dtype=np.float32)
        feeds = {"query": query, "key": query, "value": query, "mask": np.ones((1, 1, 1, length), dtype=bool)}
        times: dict[str, list[float]] = {name: [] for name in sessions}
        for s in sessions.values():  # warm up
            for _ in range(5):
                s.run(None, feeds)
        for _ in range(rounds):
            for name, s in sessions.items():
                for _ in range(reps):
                    started = time.perf_counter()
                    s.run(None, feeds)
                    times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians["float32"]
        print(
            f"[1, {length:>3}, {d_model}] "
            + "  ".join(f"{name} {m * 1e3:7.3f} ms ({m / base:4.2f}x)" for name, m in medians.items()),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=50, help="calls per graph per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    module = seeded_module(512, 8, seed=0).eval()
    graph = export_onnx(module)
    in_one_part = {f"fp16 {part}": to_float16(graph, nodes, ("attn_weights",)) for part, nodes in parts(graph).items()}
    everything = to_float16(graph, None, ("attn_weights",))
    exported = float16_attention(graph)
    print("accuracy against float64, worst over seeds and self/cross attention:")
    accuracy(
        module, {"float32": graph, **in_one_part, "fp16 everything": everything, "fp16 exported": exported}, args.seeds
    )
    print(
        f"\ntime per call in process (median of {args.rounds} alternating rounds x {args.reps} calls, "
        f"{args.threads} threads):"
    )
    timing(
        {"float32": graph, "fp16 everything": everything, "fp16 exported": exported},
        512,
        args.reps,
        args.rounds,
        args.threads,
    )


if __name__ == "__main__":
    main()
