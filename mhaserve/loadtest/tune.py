"""``mhaserve tune``'s search: server settings tried one real server process at a time under the load ``bench``
drives, for the most throughput within an SLO.

A candidate is a setting of the knobs that apply to this machine (``knobs_for``); each is served by a fresh
``mhaserve serve`` on the same free port, measured at every load point (repeated, the median kept with its
spread), and stopped. The quick search tries every pairing of queue delay and batch cap, then one knob at a time
from the best, keeping a value only where it measured better; the full sweep tries every distinct combination; the
best is then measured again beside the defaults (``confirm``). Ranking: candidates whose every SLO held at some
point first, by the throughput of their best such point; then the others, by how close they came to holding it.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from mhaserve.server.config import flag_of, setting_text
from mhaserve.server.cores import usable_cores

from .loadgen import LoadGenerator, Point, PointResult, Workload
from .slo import Slo

# A value must beat the best so far by this much to be kept: closer figures are within this machine's noise.
KEEP_IF_BETTER_BY = 1.03
# The knobs the quick search tries in every pairing, not one at a time.
JOINT = ("max_queue_delay_us", "max_batch_size")


@dataclass(frozen=True)
class Knob:
    """One server setting tune may change: its field in the server's settings, the values tried, its default."""

    name: str
    values: tuple
    default: object

    @property
    def flag(self) -> str:
        return flag_of(self.name)


def exports_knob(model_dir: Path, others: list[Path], int8_usable: bool) -> tuple[Knob | None, list[str]]:
    """Other exports of the served model (another precision) as a knob, and a line for each one left out: one
    of another model or shape, and int8 where this CPU would saturate its products (Int8Support)."""
    from mhaserve.contract.model_dir import read_manifest

    def served_as(manifest: dict) -> tuple:
        return manifest.get("name") or "mha", manifest["config"]["d_model"], manifest["config"]["num_heads"]

    base = served_as(read_manifest(model_dir))
    folders, notes = [model_dir], []
    for folder in others:
        manifest = read_manifest(folder)
        if served_as(manifest) != base:
            notes.append(f"{folder}: not an export of the same model and shape as {model_dir}; left out")
        elif manifest.get("precision") == "int8" and not int8_usable:
            notes.append(f"{folder}: int8, whose products this CPU would saturate (no VNNI); left out")
        else:
            folders.append(folder)
    if len(folders) == 1:
        return None, notes
    return Knob("model_dir", tuple(folders), model_dir), notes


def knobs_for(workload: Workload, cores: int | None = None) -> list[Knob]:
    """The knobs that can change this workload's figures on this machine: threads, inference workers and serving
    processes up to its cores,
    the output-only graph only for requests that ask for no weights, length-aware batching only for mixed
    lengths. (No CUDA knob: the one there is, TF32, changes the answers, not only their speed.)"""
    cores = cores or usable_cores()
    # Batching's own knobs first and batching on or off last: the quick search compares the best batching it
    # found with none, rather than leaving batching early and its knobs untried.
    knobs = [
        Knob("max_queue_delay_us", (0, 250, 1000, 4000), 0),
        Knob("max_batch_size", tuple(sorted({max(workload.batch, b) for b in (4, 8, 16, 32)})), 32),
        # 0 is one thread per core: the values past it are the fewer threads this machine allows
        Knob("intra_op_threads", (0, *range(1, cores)), 0),
        Knob("inference_workers", tuple(range(1, min(cores, 4) + 1)), 1),
        # serving processes on the same ports (mhaserve serve --workers), up to one per core
        Knob("workers", tuple(range(1, cores + 1)), 1),
    ]
    if workload.min_len != workload.max_len:
        knobs.append(Knob("length_aware_batching", (True, False), True))
    if not workload.attn_weights:
        knobs.append(Knob("output_only_graph", (True, False), True))
    knobs.append(Knob("dynamic_batching", (True, False), True))
    return [knob for knob in knobs if len(knob.values) > 1]


@dataclass(frozen=True)
class Candidate:
    """A setting of the knobs, as the values that differ from the defaults (sorted by name)."""

    changed: tuple[tuple[str, object], ...]

    @classmethod
    def of(cls, values: dict, knobs: list[Knob]) -> Candidate:
        """The candidate these values make, knobs that cannot matter left at their defaults: without dynamic
        batching, the batching knobs (the batch cap then only bounds a request's own batch, which every value
        tried admits); so that each distinct setting is tried once."""
        values = dict(values)
        if values.get("dynamic_batching") is False:
            for name in ("max_queue_delay_us", "length_aware_batching", "max_batch_size"):
                values.pop(name, None)
        defaults = {knob.name: knob.default for knob in knobs}
        return cls(tuple(sorted((k, v) for k, v in values.items() if defaults.get(k, object()) != v)))

    def values(self, knobs: list[Knob]) -> dict:
        return {**{knob.name: knob.default for knob in knobs}, **dict(self.changed)}

    def flags(self) -> list[str]:
        return [part for name, value in self.changed for part in (flag_of(name), setting_text(value))]

    def settings(self) -> Candidate:
        """This candidate without the export it serves (a model folder, not a setting of the server's)."""
        return Candidate(tuple((name, value) for name, value in self.changed if name != "model_dir"))

    @property
    def label(self) -> str:
        return " ".join(self.flags()) or "(defaults)"


@dataclass
class Measured:
    """One candidate's figures: its points (each the median of its repeats), its peak memory, or why it failed."""

    candidate: Candidate
    points: list[PointResult] = field(default_factory=list)
    verdicts: list[bool] = field(default_factory=list)  # per point: every SLO held
    misses: list[float] = field(default_factory=list)  # per point: its worst SLO's times over target (Slo.miss)
    peak_rss_mib: float | None = None
    failed: str = ""
    seconds: float = 0.0

    @property
    def best(self) -> PointResult | None:
        """The point it is judged by: its highest throughput where every SLO held, else its highest throughput."""
        if not self.points:
            return None
        held = [p for p, ok in zip(self.points, self.verdicts, strict=True) if ok]
        return max(held or self.points, key=lambda p: p.throughput)

    @property
    def held(self) -> bool:
        return any(self.verdicts)

    @property
    def miss(self) -> float:
        """How far its closest point is from every SLO held (Slo.miss; inf with no point)."""
        return min(self.misses, default=float("inf"))

    def rank_key(self) -> tuple:
        """Holding the SLO first, by throughput; then the others by how close they came to it."""
        best = self.best
        return (not self.failed, self.held, best.throughput if self.held else -self.miss)

    def spread(self) -> tuple[float, float] | None:
        """The best point's lowest and highest throughput over its repeats."""
        best = self.best
        if best is None or not best.rounds:
            return None
        return tuple(best.rounds["throughput_per_s"]["interval"])


def better(challenger: Measured, incumbent: Measured | None) -> bool:
    """Whether ``challenger`` should replace ``incumbent``: it holds the SLO where the other does not, or holds it
    as well with more throughput beyond the noise margin."""
    if incumbent is None:
        return True
    a, b = challenger.rank_key(), incumbent.rank_key()
    if a[:2] != b[:2]:
        return a[:2] > b[:2]
    if challenger.held:
        return a[2] > b[2] * KEEP_IF_BETTER_BY
    return challenger.miss * KEEP_IF_BETTER_BY < incumbent.miss


def quick_search(knobs: list[Knob], measure: Callable[[Candidate], Measured]) -> Iterable[Measured]:
    """Every pairing of the queue delay and the batch cap (they act together: a long delay pays only with a cap
    that fills), the defaults first; then one step per other knob from the best so far, each of its values
    tried with the rest as they are and the best kept. A setting is measured once. Yields each measurement as it
    is made."""
    defaults = {knob.name: knob.default for knob in knobs}
    joint = [knob for knob in knobs if knob.name in JOINT]
    seen: set[Candidate] = set()

    def unseen(values: dict) -> Candidate | None:
        candidate = Candidate.of(values, knobs)
        if candidate in seen:
            return None
        seen.add(candidate)
        return candidate

    pairings = []
    for values in [tuple(k.default for k in joint), *itertools.product(*(k.values for k in joint))]:
        candidate = unseen({**defaults, **dict(zip((k.name for k in joint), values, strict=True))})
        if candidate is not None:
            pairings.append(measure(candidate))
            yield pairings[-1]
    # the grid's best on equal terms, kept over the defaults only beyond the noise margin
    top = max(pairings, key=Measured.rank_key)
    best = top if better(top, pairings[0]) else pairings[0]
    for knob in (k for k in knobs if k.name not in JOINT):
        start = best.candidate.values(knobs)
        for value in knob.values:
            candidate = unseen({**start, knob.name: value})
            if candidate is not None:
                measured = measure(candidate)
                yield measured
                if better(measured, best):
                    best = measured


def confirm(best: Candidate, defaults: Candidate, measure: Callable[[Candidate], Measured], rounds: int
            ) -> Iterable[tuple[Measured, Measured]]:  # fmt: skip
    """The search's best and the defaults measured again side by side, alternating which goes first, ``rounds``
    times: the best of many noisy measurements is biased upward (the winner's curse), so it is kept only where it
    wins these. Yields (defaults, best) per round."""
    for round_number in range(rounds):
        if round_number % 2:
            tried = measure(best)
            yield measure(defaults), tried
        else:
            yield measure(defaults), measure(best)


def confirmed(rounds: list[tuple[Measured, Measured]]) -> bool:
    """Whether the best beat the defaults in most rounds (Measured ranking, beyond the noise margin)."""
    return sum(better(best, defaults) for defaults, best in rounds) * 2 > len(rounds)


def times_held(search: Measured | None, rounds: list[Measured]) -> int:
    """How often a setting held every SLO: in the search and in the side-by-side rounds."""
    return int(search is not None and search.held) + sum(m.held for m in rounds)


def keeps_leader(leader: Measured, defaults: Measured | None, rounds: list[tuple[Measured, Measured]]) -> bool:
    """Whether the search's leader stays over the defaults once measured again beside them. Holding the SLO comes
    first: the setting that held it more often, in the search and the rounds together, is kept; where both held it
    as often, the leader must win most rounds (held, then throughput beyond the noise margin)."""
    leader_held = times_held(leader, [best for _, best in rounds])
    defaults_held = times_held(defaults, [d for d, _ in rounds])
    if leader_held != defaults_held:
        return leader_held > defaults_held
    return confirmed(rounds)


def quick_plan(knobs: list[Knob]) -> int:
    """How many settings the quick search measures at most."""
    joint = [len(k.values) for k in knobs if k.name in JOINT]
    return (math.prod(joint) if joint else 1) + sum(len(k.values) - 1 for k in knobs if k.name not in JOINT)


def full_sweep(knobs: list[Knob]) -> list[Candidate]:
    """Every distinct setting of the knobs, the defaults first."""
    candidates = [Candidate.of({k.name: k.default for k in knobs}, knobs)]
    for values in itertools.product(*(knob.values for knob in knobs)):
        candidate = Candidate.of(dict(zip((k.name for k in knobs), values, strict=True)), knobs)
        if candidate not in candidates:
            candidates.append(candidate)
    return candidates


def pareto_front(measured: list[Measured]) -> list[Measured]:
    """The candidates no other beats on both throughput and p99 at their best points, by throughput."""
    scored = [m for m in measured if m.best is not None and not m.failed]
    front = [
        m
        for m in scored
        if not any(
            o.best.throughput >= m.best.throughput
            and o.best.latency_ms["p99"] <= m.best.latency_ms["p99"]
            and (o.best.throughput, o.best.latency_ms["p99"]) != (m.best.throughput, m.best.latency_ms["p99"])
            for o in scored
        )
    ]
    return sorted(front, key=lambda m: -m.best.throughput)


class CandidateRunner:
    """Serves each candidate in a fresh server process on one port and measures it with one pool of clients."""

    def __init__(
        self,
        serve_args: list[str],
        workload: Workload,
        points: list[Point],
        slos: list[Slo],
        repeats: int,
        generator: LoadGenerator,
        port: int,
        start_timeout_s: float = 120.0,
    ):
        self.serve_args, self.workload, self.points, self.slos = serve_args, workload, points, slos
        self.repeats, self.generator, self.port = repeats, generator, port
        self.start_timeout_s = start_timeout_s

    def __call__(self, candidate: Candidate) -> Measured:
        from mhaserve.loadtest.checked_load import peak_rss_mib, reset_peak_rss
        from mhaserve.server.process import ServerProcess

        from .rounds import of_rounds

        measured = Measured(candidate)
        started = time.monotonic()
        server = ServerProcess(None, *self.serve_args, *candidate.flags(), port=self.port)
        try:
            try:
                server.start(timeout=self.start_timeout_s)
            except RuntimeError:
                measured.failed = _why_not_started(server)
                return measured
            if not self.workload.d_model:  # the model's width, asked of the first server that starts
                from mhaserve.client.grpc import Client

                with Client(server.url, model=self.workload.model) as client:
                    self.workload = replace(self.workload, d_model=client.model_width(timeout=30))
            reset_peak_rss(server.pid)
            for point in self.points:
                rounds = [self.generator.measure(self.workload, point) for _ in range(self.repeats)]
                result = of_rounds(rounds) if self.repeats > 1 else rounds[0]
                measured.points.append(result)
                measured.verdicts.append(all(slo.held(result) for slo in self.slos) if result.count else False)
                measured.misses.append(max((slo.miss(result) for slo in self.slos), default=0.0))
            measured.peak_rss_mib = peak_rss_mib(server.pid)
        finally:
            server.stop()
            measured.seconds = time.monotonic() - started
        return measured


def _why_not_started(server) -> str:
    """The server's own last words: its error line, else its exit."""
    lines = [line.strip() for line in server.lines if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "cannot" in line.lower()]
    return (errors or lines or [f"exit {server.proc.poll()}"])[-1][:300]
