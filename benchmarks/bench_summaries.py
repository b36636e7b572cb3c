"""What attention summaries cost against no weights, served: side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_summaries.py [--rounds 5] [--duration 5] [--model-dir DIR]

One server of the working tree serves the embedded default model (512/8), or each folder a --model-dir names (one
exported by another revision, say, to set its summaries graph beside today's, in the same rounds). At [1, 512, 512],
one client (gRPC, closed loop, `mhaserve bench`'s load generator), each variant (--variants) of each folder in a
rotated order from round to round: no weights, the summaries (entropy, sink weight, largest weight and its key per
head and row), the mean over heads, one head, and every head's weights. Prints each round's p50 and, last, the median
p50 and its ratio to the same folder's no weights, with the ratio's spread over rounds. Not a test: BENCHMARKS.md
records the figures with this command.
"""

from __future__ import annotations

import argparse
import contextlib
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
    parser.add_argument("--model-dir", type=Path, action="append", default=None,
                        help="an exported model folder (the default model); repeatable")  # fmt: skip
    parser.add_argument("--variants", default=",".join(VARIANTS), help="those to measure, comma-separated")
    args = parser.parse_args()
    chosen = ["no weights", *(name for name in args.variants.split(",") if name != "no weights")]
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    folders = args.model_dir or [ensure_default_model()]
    measured = [(folder, name) for folder in range(len(folders)) for name in chosen]
    p50: dict[tuple[int, str], list[float]] = {each: [] for each in measured}
    with contextlib.ExitStack() as stack:
        generators = []
        for folder in folders:
            server = stack.enter_context(ServerProcess(folder))
            generators.append(stack.enter_context(LoadGenerator(server.url, 1)))
        for round_number in range(args.rounds):
            turn = round_number % len(measured)
            for folder, name in measured[turn:] + measured[:turn]:
                attn_weights, mean, options = VARIANTS[name]
                workload = Workload(512, 1, args.length, args.length, attn_weights=attn_weights,
                                    attn_weights_mean=mean, weights=options)  # fmt: skip
                result = generators[folder].measure(workload, Point("closed", 1, args.duration, args.warmup))
                p50[folder, name].append(result.latency_ms["p50"])
                print(f"round {round_number + 1} {folder_label(folders, folder)}{name:>11}: p50 "
                      f"{result.latency_ms['p50']:7.2f} ms ({result.count} requests, "
                      f"errors {sum(result.errors.values())})", flush=True)  # fmt: skip
    print(f"\n[1,{args.length},512], one client: median p50 over {args.rounds} rounds, and against no weights")
    for folder, name in measured:
        values, base = p50[folder, name], p50[folder, "no weights"]
        ratios = [value / none for value, none in zip(values, base, strict=True)]
        print(f"{folder_label(folders, folder)}{name:>11}: p50 {statistics.median(values):7.2f} ms  "
              f"{statistics.median(ratios):.2f}x (rounds {min(ratios):.2f}-{max(ratios):.2f})")  # fmt: skip


def folder_label(folders: list[Path], folder: int) -> str:
    return f"{folders[folder]}: " if len(folders) > 1 else ""


if __name__ == "__main__":
    main()
