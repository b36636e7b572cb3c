"""What each way of asking for the attention weights costs, served: side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_shaping.py [--rounds 2] [--duration 6]

One server of the working tree serves the embedded default model (512/8). At [1, 128, 512] and [1, 512, 512],
concurrency 1 and 16, each variant is measured with `mhaserve bench`'s load generator (gRPC, closed loop):
no weights, every head's weights, their mean, one head, 32 query rows, the top-8 keys of each row, top-p 0.9,
the weights in FP16. Per point: requests/s, p50 and p99, the answer's bytes (one request's outputs, as
returned), the clients' cores (they share the machine with the server), and p50 against no weights. Variants
run in a rotated order from round to round; the medians over rounds are printed last. Not a test:
BENCHMARKS.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from mhaserve.client import Client, WeightsOptions
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload, default_processes
from mhaserve.server.process import ServerProcess

# name -> (attn_weights, attn_weights_mean, options)
VARIANTS = {
    "no weights": (False, False, None),
    "all weights": (True, False, None),
    "mean": (False, True, None),
    "one head": (True, False, WeightsOptions(heads=[0])),
    "32 rows": (True, False, WeightsOptions(rows="0:32")),
    "top-8": (False, False, WeightsOptions(top_k=8)),
    "top-p 0.9": (False, False, WeightsOptions(top_p=0.9)),
    "fp16": (True, False, WeightsOptions(precision="fp16")),
}
POINTS = [(128, 1), (128, 16), (512, 1), (512, 16)]


def answer_bytes(url: str, length: int, variant) -> int:
    attn_weights, mean, options = variant
    query = np.random.default_rng(0).standard_normal((1, length, 512), dtype=np.float32)
    with Client(url) as client:
        result = client.infer(query, attn_weights=attn_weights, attn_weights_mean=mean, weights=options)
    return sum(array.nbytes for array in result.outputs.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--warmup", type=float, default=1.5)
    parser.add_argument("--processes", type=int, default=default_processes())
    args = parser.parse_args()
    results: dict[tuple, list] = {}
    with ServerProcess(ensure_default_model()) as server, LoadGenerator(server.url, args.processes) as generator:
        sizes = {
            (length, name): answer_bytes(server.url, length, v) for length, _ in POINTS for name, v in VARIANTS.items()
        }
        for round_number in range(args.rounds):
            names = list(VARIANTS)
            names = names[round_number % len(names) :] + names[: round_number % len(names)]
            for length, concurrency in POINTS:
                for name in names:
                    attn_weights, mean, options = VARIANTS[name]
                    workload = Workload(512, 1, length, length, attn_weights=attn_weights, attn_weights_mean=mean,
                                        weights=options)  # fmt: skip
                    result = generator.measure(workload, Point("closed", concurrency, args.duration, args.warmup))
                    results.setdefault((length, concurrency, name), []).append(result)
                    errors = sum(result.errors.values())
                    print(f"round {round_number + 1} [1,{length},512] c{concurrency} {name:>12}: "
                          f"{result.throughput:7.1f}/s p50 {result.latency_ms['p50']:7.2f} "
                          f"p99 {result.latency_ms['p99']:7.2f} errors {errors}", flush=True)  # fmt: skip
    print("\nmedians over rounds")
    header = f"{'point':>18} {'variant':>12} | {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'bytes':>9} {'client':>6}"
    print(f"{header} | p50/none")
    for length, concurrency in POINTS:
        base = statistics.median(r.latency_ms["p50"] for r in results[(length, concurrency, "no weights")])
        for name in VARIANTS:
            runs = results[(length, concurrency, name)]
            p50 = statistics.median(r.latency_ms["p50"] for r in runs)
            print(
                f"{f'[1,{length},512] c{concurrency}':>18} {name:>12} | "
                f"{statistics.median(r.throughput for r in runs):7.1f} {p50:7.2f} "
                f"{statistics.median(r.latency_ms['p99'] for r in runs):7.2f} {sizes[(length, name)]:9d} "
                f"{statistics.median(r.client_cpu_cores for r in runs):6.2f} | {p50 / base:5.2f}"
            )


if __name__ == "__main__":
    main()
