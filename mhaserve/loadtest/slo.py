"""Latency targets for ``mhaserve bench --slo``: whether each point met them (a CI gate), and its goodput.

An SLO is ``p50<10ms``, ``p90<..``, ``p99<..``, ``p99.9<0.2s`` (ms or s), ``errors<1%`` (of the requests sent),
``throughput>100`` (successful requests a second) or ``breaches=0`` (answers that broke the export's tolerance in the
server's live parity checks; ``breaches<N`` allows fewer than N). Goodput is the requests a second answered within
every latency target: the tightest of them, applied to each request (as AIPerf's ``--goodput``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .loadgen import PointResult

LATENCIES = ("p50", "p90", "p95", "p99", "p99.9")
# One way to read each number (digits, then an optional fraction; or a fraction alone): a pattern with two ways
# ([0-9]*\.?[0-9]+) backtracks over every split of a long run of digits that fails to match, quadratic in its length.
_SLO = re.compile(
    r"^\s*(p50|p90|p95|p99|p99\.9|errors|throughput|breaches)\s*([<>=])\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(ms|s|%)?\s*$"
)


@dataclass(frozen=True)
class Slo:
    metric: str  # one of LATENCIES, "errors", "throughput", "breaches"
    limit: float  # ms for a latency, a fraction for errors, requests/s for throughput, breaches allowed
    text: str  # as the user wrote it

    def observed(self, result: PointResult) -> float:
        if self.metric == "breaches":  # NaN where the server checked none (no live parity)
            parity = (result.server or {}).get("parity")
            return math.nan if parity is None or not parity["checked"] else float(parity["breached"])
        if self.metric == "throughput":
            return result.throughput
        if self.metric == "errors":
            sent = result.count + sum(result.errors.values())
            return sum(result.errors.values()) / sent if sent else 0.0
        return result.latency_ms[self.metric]

    def miss(self, result: PointResult) -> float:
        """How many times over its target the point is (below 1: held with room; inf: nothing answered)."""
        observed = self.observed(result)
        if np.isnan(observed):
            return math.inf
        if self.metric == "throughput":
            return self.limit / observed if observed else math.inf
        return observed / self.limit if self.limit else (math.inf if observed else 0.0)

    def held(self, result: PointResult) -> bool:
        observed = self.observed(result)
        if np.isnan(observed):  # no request answered: no latency held
            return False
        if self.metric == "breaches":
            return observed <= self.limit
        return observed > self.limit if self.metric == "throughput" else observed < self.limit

    def shown(self, value: float) -> str:
        if self.metric == "breaches":
            return "no answer checked (serve with --parity-share)" if np.isnan(value) else f"{value:.0f} breached"
        if self.metric == "errors":
            return f"{value * 100:.2f}%"
        return f"{value:.1f}/s" if self.metric == "throughput" else f"{value:.3f} ms"


def parse_slo(text: str) -> Slo:
    """``p99<20ms``, ``errors<1%``, ``throughput>100``; ValueError saying what is expected otherwise."""
    match = _SLO.match(text)
    if match is None:
        raise ValueError(
            f"--slo {text!r}: expected p50, p90, p95, p99 or p99.9 '<' a time (e.g. p99<20ms, p99.9<0.5s), "
            "errors<N%, throughput>N, or breaches=0"
        )
    metric, sign, number, unit = match.groups()
    value = float(number)
    if not math.isfinite(value):
        raise ValueError(f"--slo {text[:40]!r}...: the number is too large to be a target")
    if metric == "breaches":
        if sign == ">" or unit is not None or not value.is_integer() or (sign == "<" and value < 1):
            raise ValueError(f"--slo {text!r}: a parity target reads like breaches=0 (at most that many) or "
                             "breaches<5 (fewer than that)")  # fmt: skip
        return Slo(metric, value if sign == "=" else value - 1, text.strip())
    if sign == "=":
        raise ValueError(f"--slo {text!r}: '=' is for breaches=N; a {metric} target takes '<' or '>'")
    if metric in LATENCIES:
        if sign != "<" or unit not in ("ms", "s"):
            raise ValueError(f"--slo {text!r}: a latency target reads like {metric}<20ms or {metric}<0.5s")
        return Slo(metric, value * 1000 if unit == "s" else value, text.strip())
    if metric == "errors":
        if sign != "<" or unit != "%":
            raise ValueError(f"--slo {text!r}: an error target reads like errors<1%")
        return Slo(metric, value / 100, text.strip())
    if sign != ">" or unit is not None:
        raise ValueError(f"--slo {text!r}: a throughput target reads like throughput>100 (requests a second)")
    return Slo(metric, value, text.strip())


def goodput(result: PointResult, slos: list[Slo]) -> float | None:
    """Requests a second answered within the tightest latency target; None where no latency target is set."""
    limits = [slo.limit for slo in slos if slo.metric in LATENCIES]
    if not limits:
        return None
    return int(np.count_nonzero(result.latencies_ms <= min(limits))) / result.point.duration_s


def verdicts(result: PointResult, slos: list[Slo]) -> list[dict]:
    return [{"slo": slo.text, "held": slo.held(result), "observed": slo.shown(slo.observed(result))} for slo in slos]


def summary(results: list[PointResult], slos: list[Slo]) -> list[dict]:
    """Per SLO, over the whole run: PASS where it held at every point, and its worst point (as k6 reports a
    threshold): {"slo", "passed", "worst", "at"}."""
    lines = []
    for slo in slos:
        observed = [slo.observed(r) for r in results]
        shortfalls = [_shortfall(slo, value) for value in observed]
        worst = shortfalls.index(max(shortfalls))
        lines.append({
            "slo": slo.text,
            "passed": all(slo.held(r) for r in results),
            "worst": slo.shown(observed[worst]),
            "at": results[worst].point.label,
        })  # fmt: skip
    return lines


def _shortfall(slo: Slo, observed: float) -> float:
    """How far a point is from holding ``slo``, to find its worst: an unanswered point first, else the lowest
    throughput, or the highest latency or error rate."""
    if np.isnan(observed):
        return math.inf
    return -observed if slo.metric == "throughput" else observed


def summary_lines(summarised: list[dict]) -> list[str]:
    """The verdict lines that end a run: one per SLO, then the whole run's."""
    lines = [f"{'PASS' if s['passed'] else 'FAIL'}  {s['slo']}  (worst: {s['worst']} at {s['at']})" for s in summarised]
    held = sum(s["passed"] for s in summarised)
    return [*lines, f"{'PASS' if held == len(summarised) else 'FAIL'}: {held} of {len(summarised)} SLOs held"]
