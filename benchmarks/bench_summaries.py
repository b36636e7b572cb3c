"""What attention summaries cost against no weights, served: side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_summaries.py [--rounds 5] [--duration 5] [--model-dir DIR]

One server of the working tree serves the embedded default model (512/8), or the folder --model-dir names (one
exported by another revision, to set its summaries graph beside today's in alternating runs). At [1, 512, 512], one
client (gRPC, closed loop, `mhaserve bench`'s load generator), each variant (--variants) in a rotated order from
round to round: no weights, the summaries (entropy, sink weight, largest weight and its key per head and row), the
mean over heads, one head, and every head's weights. Prints each round's p50 and, last, the median p50 and its ratio
to no weights, with the ratio's spread over rounds. Not a test: BENCHMARKS.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from mhaserve.client import WeightsOptions
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload
from mhaserve.server.process import ServerProcess

# name -> (attn_weights, attn_weights_mean, options)
VARIANTS = {
    "no weights": (False, False, None),
    "summaries": (False, False, WeightsOptions(summaries=True)),
    "mean": (False, True, None),
    "one head": (True, False, WeightsOptions(heads=[0])),
    "every head": (True, False, None),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--model-dir", type=Path, default=None, help="an exported model folder (the default model)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="those to measure, comma-separated")
    args = parser.parse_args()
    chosen = ["no weights", *(name for name in args.variants.split(",") if name != "no weights")]
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    p50: dict[str, list[float]] = {name: [] for name in chosen}
    with ServerProcess(args.model_dir or ensure_default_model()) as server, LoadGenerator(server.url, 1) as generator:
        for round_number in range(args.rounds):
            names = list(chosen)
            names = names[round_number % len(names) :] + names[: round_number % len(names)]
            for name in names:
                attn_weights, mean, options = VARIANTS[name]
                workload = Workload(512, 1, args.length, args.length, attn_weights=attn_weights,
                                    attn_weights_mean=mean, weights=options)  # fmt: skip
                result = generator.measure(workload, Point("closed", 1, args.duration, args.warmup))
                p50[name].append(result.latency_ms["p50"])
                print(f"round {round_number + 1} {name:>11}: p50 {result.latency_ms['p50']:7.2f} ms "
                      f"({result.count} requests, errors {sum(result.errors.values())})", flush=True)  # fmt: skip
    print(f"\n[1,{args.length},512], one client: median p50 over {args.rounds} rounds, and against no weights")
    base = p50["no weights"]
    for name, values in p50.items():
        ratios = [value / none for value, none in zip(values, base, strict=True)]
        print(f"{name:>11}: p50 {statistics.median(values):7.2f} ms  {statistics.median(ratios):.2f}x "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
