"""What tracing costs the server: a revision before tracing existed, this tree with tracing off, tracing one
request in 100 (``--trace-config rate=100``) and every request (``rate=1``), side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_tracing.py --baseline REV [--rounds 3] [--duration 8]

Four servers of the embedded default model (512/8) are up for the whole run; each point is measured on each in
turn, in a rotated order from round to round, with `mhaserve bench`'s load generator (gRPC, with the attention
weights). The traced servers export over OTLP gRPC to a receiver in this process (the spans are really sent and
decoded: that is the receiver's cost, on the clients' side). Per point: requests/s, p50 and p99 of each, and the
ratio of each variant's requests/s to the baseline's, per round and as the median. Not a test: BENCHMARKS.md
records the figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from bench_revisions import ROOT, add_round_arguments, baseline_checkout, parse_points

from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload
from mhaserve.server.process import ServerProcess

sys.path.insert(0, str(ROOT))
from tests.support.otlp import OtlpReceiver  # noqa: E402

VARIANTS = {  # name: the current tree's flags (None: the baseline revision)
    "baseline": None,
    "off": (),
    "rate 100": ("--trace-config", "mode=opentelemetry", "--trace-config", "rate=100"),
    "rate 1": ("--trace-config", "mode=opentelemetry", "--trace-config", "rate=1"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="a revision before tracing (e.g. HEAD~3)")
    add_round_arguments(parser, "16x16,16x1")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    receiver = OtlpReceiver("grpc")
    otel = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    servers = {}
    try:
        with baseline_checkout(args.baseline) as (baseline_env, _):
            for name, flags in VARIANTS.items():
                if flags is None:
                    servers[name] = ServerProcess(model_dir, env=baseline_env).start()
                else:
                    servers[name] = ServerProcess(model_dir, *flags, env=otel).start()
            measure(servers, args)
            print(f"\nspans received: {len(receiver.spans)}")
    finally:
        for server in servers.values():
            server.stop()
        receiver.close()


def measure(servers: dict[str, ServerProcess], args) -> None:
    names = list(servers)
    print(f"{'point':>16} {'round':>5} " + " | ".join(f"{n:>8} req/s p50 p99" for n in names))
    ratios: dict[tuple[tuple[int, int], str], list[float]] = {}
    points = parse_points(args.points)
    for round_number in range(args.rounds):
        order = names[round_number % len(names) :] + names[: round_number % len(names)]
        for length, concurrency in points:
            workload = Workload(512, 1, length, length, attn_weights=True)
            point = Point("closed", concurrency, args.duration, args.warmup)
            results = {}
            for name in order:
                with LoadGenerator(servers[name].url, args.processes) as generator:
                    results[name] = generator.measure(workload, point)
            for name in names[1:]:
                ratio = results[name].throughput / results["baseline"].throughput
                ratios.setdefault(((length, concurrency), name), []).append(ratio)
            cells = [f"{results[n].throughput:8.1f} {results[n].latency_ms['p50']:5.2f} "
                     f"{results[n].latency_ms['p99']:6.2f}" for n in names]  # fmt: skip
            print(f"[1,{length:>3},512] c{concurrency:<3} {round_number + 1:>5} " + " | ".join(cells), flush=True)
    print("\nmedian ratio, requests/s against the baseline:")
    for ((length, concurrency), name), values in ratios.items():
        rounds = ", ".join(f"{v:.2f}" for v in values)
        print(f"[1,{length:>3},512] c{concurrency:<3} {name:>9}: {statistics.median(values):.3f} ({rounds})")


if __name__ == "__main__":
    main()
