"""The output-only graph against the full graph for requests that ask for no attention weights: side by side.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_output_only.py [--rounds 3] [--duration 5]

On the embedded default model (512/8), at L = 16, 128, 512 and 1024 (batch 1, self-attention):
- in process: ONNX Runtime running model.onnx for its output alone (what a request without weights ran
  before) against model_output_only.onnx, with three masks: every key allowed (FlashAttention), a quarter
  of the keys masked (the fused kernel with a bias), causal; medians of each round's median, and the ratio;
- served: two servers of the working tree on the same folder, one with --output-only-graph false, measured
  in turn by `mhaserve bench`'s load generator (gRPC, closed loop, no weights) at concurrency 1 and 16.
Not a test: BENCHMARKS.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import onnxruntime as ort

from mhaserve.contract.model_dir import MODEL_FILE, OUTPUT_ONLY_FILE
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload, default_processes
from mhaserve.server.process import ServerProcess

LENGTHS = (16, 128, 512, 1024)
D_MODEL = 512
LIMITS = ("--max-q-len", "1024", "--max-kv-len", "1024")


def masks(length: int) -> dict[str, np.ndarray]:
    padded = np.ones((1, 1, 1, length), dtype=bool)
    padded[..., length - length // 4 :] = False
    return {
        "every key": np.ones((1, 1, 1, length), dtype=bool),
        "key padding": padded,
        "causal": np.tril(np.ones((length, length), dtype=bool))[None, None],
    }


def median_run_ms(session: ort.InferenceSession, feeds: dict, runs: int) -> float:
    for _ in range(3):
        session.run(["output"], feeds)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        session.run(["output"], feeds)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def in_process(model_dir, rounds: int) -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    sessions = {
        name: ort.InferenceSession(str(model_dir / file), options, providers=["CPUExecutionProvider"])
        for name, file in (("full", MODEL_FILE), ("output-only", OUTPUT_ONLY_FILE))
    }
    rng = np.random.default_rng(0)
    print(f"in process ({options.intra_op_num_threads} threads): ms per run, median of {rounds} rounds")
    print(f"{'L':>5} {'mask':>12} | {'full':>8} {'output-only':>11} | full/output-only")
    for length in LENGTHS:
        query = rng.standard_normal((1, length, D_MODEL), dtype=np.float32)
        runs = 200 if length <= 128 else 40
        for mask_name, mask in masks(length).items():
            feeds = {"query": query, "key": query, "value": query, "mask": mask}
            measured = {name: [] for name in sessions}
            for round_number in range(rounds):
                order = list(sessions) if round_number % 2 == 0 else list(sessions)[::-1]
                for name in order:
                    measured[name].append(median_run_ms(sessions[name], feeds, runs))
            full, only = (statistics.median(measured[name]) for name in sessions)
            print(f"{length:>5} {mask_name:>12} | {full:8.2f} {only:11.2f} | {full / only:5.2f}", flush=True)


def served(model_dir, rounds: int, duration: float, warmup: float, processes: int) -> None:
    print(f"\nserved (gRPC, no weights, closed loop, {duration:.0f} s per point): medians of {rounds} rounds")
    results: dict[tuple, list] = {}
    with (
        ServerProcess(model_dir, *LIMITS) as with_graph,
        ServerProcess(model_dir, *LIMITS, "--output-only-graph", "false") as without_graph,
    ):
        servers = {"output-only": with_graph, "full": without_graph}
        generators = {name: LoadGenerator(server.url, processes) for name, server in servers.items()}
        try:
            for round_number in range(rounds):
                for length in LENGTHS:
                    for concurrency in (1, 16):
                        order = list(servers) if round_number % 2 == 0 else list(servers)[::-1]
                        for name in order:
                            workload = Workload(D_MODEL, 1, length, length, attn_weights=False)
                            result = generators[name].measure(workload, Point("closed", concurrency, duration, warmup))
                            results.setdefault((length, concurrency, name), []).append(result)
                            print(f"round {round_number + 1} L={length} c{concurrency} {name:>11}: "
                                  f"{result.throughput:7.1f}/s p50 {result.latency_ms['p50']:7.2f} "
                                  f"errors {sum(result.errors.values())}", flush=True)  # fmt: skip
        finally:
            for generator in generators.values():
                generator.close()
    print(f"\n{'point':>10} | {'full req/s':>10} {'p50':>7} {'p99':>7} | {'output-only req/s':>17} {'p50':>7} "
          f"{'p99':>7} | req/s ratio  p50 full/output-only | client cores")  # fmt: skip
    for length in LENGTHS:
        for concurrency in (1, 16):
            row = {}
            for name in ("full", "output-only"):
                runs = results[(length, concurrency, name)]
                row[name] = (
                    statistics.median(r.throughput for r in runs),
                    statistics.median(r.latency_ms["p50"] for r in runs),
                    statistics.median(r.latency_ms["p99"] for r in runs),
                    statistics.median(r.client_cpu_cores for r in runs),
                )
            full, only = row["full"], row["output-only"]
            print(f"{f'L={length} c{concurrency}':>10} | {full[0]:10.1f} {full[1]:7.2f} {full[2]:7.2f} | "
                  f"{only[0]:17.1f} {only[1]:7.2f} {only[2]:7.2f} | {only[0] / full[0]:11.2f} "
                  f"{full[1] / only[1]:21.2f} | {only[3]:.2f}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--processes", type=int, default=default_processes())
    args = parser.parse_args()
    model_dir = ensure_default_model()
    in_process(model_dir, args.rounds)
    served(model_dir, args.rounds, args.duration, args.warmup, args.processes)


if __name__ == "__main__":
    main()
