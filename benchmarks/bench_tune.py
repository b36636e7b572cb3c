"""How close `mhaserve tune`'s quick search comes to the full sweep's best, on the same measurements: the quick
search is replayed over a full sweep's --json (each candidate it would try looked up there), so noise between two
separate runs does not enter the ratio. Also prints the quick search's own run, where one is given.

    flock /tmp/bench.lock .venv/bin/mhaserve tune --search full --slo 'p99<12ms' --concurrency 4,8,16 --json full.json
    .venv/bin/python benchmarks/bench_tune.py full.json [quick.json]

Not a test: BENCHMARKS.md ("mhaserve tune") records the figures with these commands.
"""

from __future__ import annotations

import json
import sys

from mhaserve.loadtest.loadgen import Point, PointResult, Workload
from mhaserve.loadtest.slo import parse_slo
from mhaserve.loadtest.tune import Candidate, Measured, knobs_for, quick_search

LATENCIES = ("p50", "p90", "p95", "p99", "p99.9", "max", "mean")


def measured_of(entry: dict, slos: list) -> Measured:
    """A candidate of a tune's --json, as the search saw it."""
    points = []
    for row in entry["points"]:
        point = Point(row["mode"], row["load"], row["duration_s"], 0.0)
        latencies = {name: row[f"{name}_ms"] for name in LATENCIES}
        points.append(PointResult(point, Workload(0), row["processes"], row["requests"], row["throughput_per_s"],
                                  latencies, {}, {}, 0.0, False, 0.0, 0, None))  # fmt: skip
    changed = tuple(sorted((k, v) for k, v in entry["setting"].items()))
    verdicts = [row["slo_held"] for row in entry["points"]]
    misses = [max(slo.miss(p) for slo in slos) for p in points]
    return Measured(Candidate(changed), points, verdicts, misses, entry["peak_rss_mib"], entry["failed"] or "")


def main() -> None:
    full = json.loads(open(sys.argv[1]).read())
    slos = [parse_slo(text) for text in full["slo"]]
    by_setting = {m.candidate: m for m in (measured_of(e, slos) for e in full["candidates"])}
    shape = full["title"].split()[0]  # "[1,16,512]" or "[1,16..128,512]"
    mixed = ".." in shape
    output_only = "output only" in full["title"]
    workload = Workload(512, 1, 16, 128 if mixed else 16, attn_weights=not output_only)
    knobs = knobs_for(workload)
    replay = list(quick_search(knobs, lambda candidate: by_setting[candidate]))
    quick_best = max(replay, key=Measured.rank_key)
    full_best = max(by_setting.values(), key=Measured.rank_key)
    ratio = quick_best.best.throughput / full_best.best.throughput
    print(f"full sweep: {len(by_setting)} candidates; best {full_best.candidate.label} "
          f"{full_best.best.throughput:.1f} req/s at {full_best.best.point.label}")  # fmt: skip
    print(f"quick search replayed on those figures: {len(replay)} candidates ({len(replay) / len(by_setting):.0%} of "
          f"the runs); best {quick_best.candidate.label} {quick_best.best.throughput:.1f} req/s: {ratio:.2f} of the "
          "full sweep's best")  # fmt: skip
    defaults = by_setting[Candidate(())]
    print(f"the defaults in the full sweep: {defaults.best.throughput:.1f} req/s at {defaults.best.point.label} "
          f"(SLO {'held' if defaults.held else 'missed'}); the full sweep's best "
          f"{full_best.best.throughput / defaults.best.throughput:.2f}x")  # fmt: skip
    if len(sys.argv) > 2:
        quick = json.loads(open(sys.argv[2]).read())
        own = {m.candidate: m for m in (measured_of(e, slos) for e in quick["candidates"])}
        chosen = max(own.values(), key=Measured.rank_key)
        in_full = by_setting.get(chosen.candidate)
        print(f"the quick search's own run chose {chosen.candidate.label} ({chosen.best.throughput:.1f} req/s there); "
              + (f"measured in the full sweep: {in_full.best.throughput:.1f} req/s, "
                 f"{in_full.best.throughput / full_best.best.throughput:.2f} of its best" if in_full else
                 "not a candidate of the full sweep"))  # fmt: skip


if __name__ == "__main__":
    main()
