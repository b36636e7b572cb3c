"""Length-aware batching against one padded run per drain: the same server, A/B through its flag, one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_batching.py [--duration 10] [--warmup 2]

Two servers on the embedded default model (512/8), identical but for --length-aware-batching, both up
for the whole run; each point is measured on one, then the other (only the measured one gets load),
with `mhaserve bench`'s load generator. Per point and server: throughput, p50 and p99, errors, the
clients' CPU, and the mean padding share of the runs in that point (from the server's
mhaserve_inference_padding_ratio histogram). Not a test: it prints numbers; BENCHMARKS.md records them.
``--policy NAME="SERVER ARGS"`` (repeated) measures other servers instead, for example a thread layout:
``--policy padded="--length-aware-batching false" --policy aware-2x1="--inference-workers 2 --intra-op-threads 1"``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from mhaserve.cli import ensure_default_model
from mhaserve.loadgen import LoadGenerator, Point, Workload, default_processes
from mhaserve.server_process import ServerProcess

# (min length, max length, concurrency). The equal-length points at 72 and 264, the mean of 16..128 and of
# 16..512, bound what any batching policy can reach on those ranges: as many tokens per request on average,
# none of them padding, and fewer query-key pairs (uniform 16..128 has E[L^2] = 6229, 72^2 is 5184).
POINTS = [
    (16, 128, 16),
    (16, 128, 64),
    (72, 72, 16),
    (72, 72, 64),
    (16, 512, 16),
    (16, 512, 64),
    (264, 264, 16),
    (16, 16, 16),
    (128, 128, 16),
]
POLICIES = {"padded": "--length-aware-batching false", "length-aware": "--length-aware-batching true"}


def padding_totals(server: ServerProcess) -> tuple[float, float]:
    """(sum, count) of the padding-ratio histogram: the mean over a stretch is the ratio of their deltas."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
    values = {s.name: s.value for f in families if f.name == "mhaserve_inference_padding_ratio" for s in f.samples}
    return values.get("mhaserve_inference_padding_ratio_sum", 0.0), values.get(
        "mhaserve_inference_padding_ratio_count", 0.0
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1, help="rounds per point, alternating the servers' order")
    parser.add_argument("--max-len", type=int, default=512, help="only the points whose lengths reach no further")
    parser.add_argument(
        "--policy",
        action="append",
        metavar="NAME=SERVER ARGS",
        help="a server to measure instead of the two defaults (repeatable; ratios are to the first)",
    )
    args = parser.parse_args()
    policies = dict(p.split("=", 1) for p in args.policy) if args.policy else POLICIES
    model_dir = ensure_default_model()
    servers = {name: ServerProcess(model_dir, *flags.split()).start() for name, flags in policies.items()}
    first = next(iter(servers))
    for name, server in servers.items():
        fitted = [line.split("run cost model ")[1].strip() for line in server.lines if "run cost model" in line]
        print(f"{name}: {server.url}" + (f"; run cost model {fitted[0]}" if fitted else ""))
    processes = default_processes()
    print(f"client processes: {processes}; {args.warmup:g} s warm-up + {args.duration:g} s per point\n")
    print(f"{'lengths':>9} {'c':>3} {'round':>5} {'policy':>12} | {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} "
          f"{'errors':>6} {'client cores':>12} {'padding':>7} |")  # fmt: skip
    try:
        for low, high, concurrency in [p for p in POINTS if p[1] <= args.max_len]:
            workload = Workload(512, 1, low, high, attn_weights=True)
            point = Point("closed", concurrency, args.duration, args.warmup)
            lengths = f"{low}..{high}" if low != high else str(low)
            ratios: dict[str, list[float]] = {name: [] for name in servers if name != first}
            for round_ in range(1, args.rounds + 1):
                # Alternating order: whichever server goes first in a round does not always go first.
                order = list(servers.items()) if round_ % 2 else list(reversed(servers.items()))
                results = {}
                for name, server in order:
                    before = padding_totals(server)
                    with LoadGenerator(server.url, processes) as generator:
                        results[name] = result = generator.measure(workload, point)
                    after = padding_totals(server)
                    runs = after[1] - before[1]
                    padding = (after[0] - before[0]) / runs if runs else 0.0
                    print(
                        f"{lengths:>9} {concurrency:>3} {round_:>5} {name:>12} | {result.throughput:7.1f} "
                        f"{result.latency_ms['p50']:7.2f} {result.latency_ms['p99']:7.2f} "
                        f"{sum(result.errors.values()):>6} {result.client_cpu_cores:12.2f} {padding:7.2f} |",
                        flush=True,
                    )
                for name in ratios:
                    ratios[name].append(results[name].throughput / results[first].throughput)
            for name, values in ratios.items():
                listed = ", ".join(f"{v:.2f}" for v in values)
                print(f"{lengths:>9} {concurrency:>3} {name} / {first}: median {statistics.median(values):.2f} "
                      f"({listed})\n", flush=True)  # fmt: skip
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
