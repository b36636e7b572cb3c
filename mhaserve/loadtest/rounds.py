"""Repeated measurements of a point, and two runs compared: a point measured ``--rounds N`` times is reported
by its median round, with each figure's spread over the rounds (lowest to highest) as its interval; two runs'
points are compared figure by figure, "within noise" where the intervals overlap."""

from __future__ import annotations

import statistics

from .loadgen import Point, PointResult

FIGURES = (("throughput_per_s", "req/s"), ("p50_ms", "p50"), ("p99_ms", "p99"))


def of_rounds(rounds: list[PointResult]) -> PointResult:
    """The round of median throughput (the lower median of an even count), carrying every round's figures."""
    ordered = sorted(rounds, key=lambda r: r.throughput)
    median = ordered[(len(ordered) - 1) // 2]
    figures = {
        "throughput_per_s": [r.throughput for r in rounds],
        "p50_ms": [r.latency_ms["p50"] for r in rounds],
        "p99_ms": [r.latency_ms["p99"] for r in rounds],
    }
    median.rounds = {
        "n": len(rounds),
        **{
            name: {"median": statistics.median(v), "interval": [min(v), max(v)], "rounds": v}
            for name, v in figures.items()
        },
    }
    return median


def rounds_line(r: PointResult) -> str:
    """The figures the table shows (the median round's) with each one's lowest and highest over the rounds."""
    shown = {"throughput_per_s": r.throughput, "p50_ms": r.latency_ms["p50"], "p99_ms": r.latency_ms["p99"]}
    parts = []
    for name, label in FIGURES:
        low, high = r.rounds[name]["interval"]
        parts.append(f"{label} {shown[name]:.3f} [{low:.3f}, {high:.3f}]")
    return (f"rounds at {r.point.label}: {r.rounds['n']}; the median round (by req/s), each figure [lowest, "
            "highest] over the rounds: " + ", ".join(parts))  # fmt: skip


def _key(point: dict) -> tuple:
    return point["mode"], float(point["load"]), point["shape"], point.get("attn_weights"), point.get("weights_options")


def _figure(point: dict, name: str) -> tuple[float, list[float] | None]:
    rounds = point.get("rounds")
    if rounds:
        return rounds[name]["median"], rounds[name]["interval"]
    return float(point[name]), None


def compare(before: dict, after: dict) -> list[str]:
    """One line per point both runs measured: after / before for throughput, p50 and p99, and whether each
    differs beyond the rounds' spread ("within noise" where the intervals overlap)."""
    earlier = {_key(p): p for p in before["points"]}
    lines = []
    for point in after["points"]:
        base = earlier.get(_key(point))
        if base is None:
            continue
        label = f"{Point(point['mode'], point['load'], point['duration_s'], 0).label} {point['shape']}"
        cells, verdicts = [], []
        for name, shown in FIGURES:
            was, was_interval = _figure(base, name)
            now, now_interval = _figure(point, name)
            ratio = now / was if was else float("nan")
            cells.append(f"{shown} {ratio:.2f} ({was:.3f} -> {now:.3f})")
            if was_interval is None or now_interval is None:
                verdicts.append(f"{shown}: one round, noise unknown")
            elif now_interval[0] <= was_interval[1] and was_interval[0] <= now_interval[1]:
                verdicts.append(f"{shown} within noise")
            else:
                verdicts.append(f"{shown} {'higher' if ratio > 1 else 'lower'} beyond noise")
        lines.append(f"{label}: " + ", ".join(cells) + "; " + ", ".join(verdicts))
    return lines
