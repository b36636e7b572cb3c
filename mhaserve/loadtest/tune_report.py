"""What ``mhaserve tune`` reports: a line per candidate as it goes, then the candidates ranked, the chosen setting
against the defaults, the throughput-p99 front; as text, JSON, an HTML page with its plot, and the chosen setting
as the MHASERVE_* variables the server reads."""

from __future__ import annotations

import base64
import html
import json
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from mhaserve.server.config import flag_of, setting_text

from .loadgen import Point, Workload
from .slo import Slo
from .tune import Measured, better, keeps_leader, pareto_front, times_held

# Settings of the whole server that a model's config.pbtxt does not hold: served as flags beside it.
SERVER_WIDE = ("inference_workers", "workers")
COLUMNS = ("setting", "req/s", "spread", "p50 ms", "p99 ms", "SLO", "peak RSS MiB", "at")


def _figures(m: Measured) -> list[str]:
    best = m.best
    if m.failed or best is None:
        return [m.candidate.label, "", "", "", "", "failed", "", m.failed]
    spread = m.spread()
    return [
        m.candidate.label,
        f"{best.throughput:.1f}",
        f"{spread[0]:.0f}-{spread[1]:.0f}" if spread else "",
        f"{best.latency_ms['p50']:.2f}",
        f"{best.latency_ms['p99']:.2f}",
        "held" if m.held else "missed",
        f"{m.peak_rss_mib:.0f}" if m.peak_rss_mib is not None else "",
        best.point.label,
    ]


def within_slo(m: Measured) -> str:
    """A candidate's throughput where the SLO held, for a line."""
    if m.failed or m.best is None:
        return "failed to start"
    return f"{m.best.throughput:.1f} req/s" if m.held else f"SLO missed ({m.miss:.2f} times its target)"


def progress_line(n: int, planned: int, m: Measured, so_far: list[Measured]) -> str:
    leader = max(so_far, key=Measured.rank_key)
    figures = (
        "failed to start: " + m.failed
        if m.failed
        else ", ".join(f"{c} {v}" for c, v in zip(COLUMNS[1:6], _figures(m)[1:6], strict=True) if v)
    )
    best = leader.best
    lead = f"{leader.candidate.label} {best.throughput:.1f} req/s" if best is not None else "none yet"
    return f"[{n}/{planned}] {m.candidate.label}: {figures} ({m.seconds:.0f} s); best so far: {lead}"


@dataclass
class TuneRun:
    measured: list[Measured]
    slos: list[Slo]
    points: list[Point]
    workload: Workload
    search: str
    served: str  # the model flags every candidate was served with
    interrupted: bool
    command: list[str]
    confirmation: list[tuple[Measured, Measured]] | None = None  # (defaults, best) measured again per round

    @property
    def ranked(self) -> list[Measured]:
        return sorted(self.measured, key=Measured.rank_key, reverse=True)

    @property
    def defaults(self) -> Measured | None:
        return next((m for m in self.measured if not m.candidate.changed), None)

    @property
    def leader(self) -> Measured | None:
        """The search's best candidate that held every SLO; None where none did."""
        best = self.ranked[0] if self.measured else None
        return best if best is not None and best.held and not best.failed else None

    @property
    def chosen(self) -> Measured | None:
        """The leader, where the side-by-side rounds kept it over the defaults (or none were run); else the
        defaults, which then held the SLO at least as often (tune.keeps_leader)."""
        leader = self.leader
        if leader is None or not leader.candidate.changed or not self.confirmation:
            return leader
        return leader if keeps_leader(leader, self.defaults, self.confirmation) else self.defaults

    def confirmation_line(self) -> str | None:
        if not self.confirmation:
            return None
        leader, rounds = self.leader, self.confirmation
        each = "; ".join(f"{within_slo(b)} against {within_slo(d)}" for d, b in rounds)
        measurements = len(rounds) + 1
        leader_held = times_held(leader, [b for _, b in rounds])
        defaults_held = times_held(self.defaults, [d for d, _ in rounds])
        kept = keeps_leader(leader, self.defaults, rounds)
        if leader_held != defaults_held:
            why = f"it held the SLO {'more' if kept else 'less'} often"
        else:
            why = f"both held it as often, and it won {sum(better(b, d) for d, b in rounds)} of the rounds"
        verdict = "kept" if kept else "not kept: the defaults stay"
        return (f"side by side with the defaults, {len(rounds)} alternating rounds: {leader.candidate.label} {each}; "
                f"with the search, it held every SLO in {leader_held} of {measurements} measurements, the defaults "
                f"in {defaults_held}; {why}: {verdict}")  # fmt: skip

    @property
    def title(self) -> str:
        load = ", ".join(p.label for p in self.points)
        weights = "with attn_weights" if self.workload.attn_weights else "output only"
        return f"{self.workload.shape_text} {weights} at {load}; SLO {', '.join(s.text for s in self.slos)}"

    def serve_command(self, m: Measured, model_config: Path | None = None) -> str:
        """The command that serves ``m``'s setting: as flags; or, with the setting in the model's ``model_config``,
        the flags of the server's own settings (serving processes, and the inference workers its instance count
        needs)."""
        changed = dict(m.candidate.changed)
        served = f"--model-dir {changed['model_dir']}" if "model_dir" in changed else self.served
        if model_config is None:
            return " ".join(["mhaserve serve", served, *m.candidate.settings().flags()])
        # the server's own settings a model's configuration cannot hold (its instance count needs the server's
        # inference workers too)
        server_flags = [f"{flag_of(name)} {setting_text(changed[name])}" for name in SERVER_WIDE if name in changed]
        return " ".join(["mhaserve serve", served, *server_flags])

    def write_model_config(self, path: Path, name: str) -> None:
        """The chosen setting as the model's config.pbtxt (Triton's fields where they mean the same)."""
        from mhaserve.server.model_config import config_text

        chosen = self.chosen
        header = f"# mhaserve tune: {self.title}\n# {chosen.best.throughput:.1f} req/s, p99 " \
                 f"{chosen.best.latency_ms['p99']:.2f} ms at {chosen.best.point.label}\n"  # fmt: skip
        values = {key: value for key, value in chosen.candidate.settings().changed if key != "workers"}
        path.write_text(header + config_text(name, values))

    def lines(self) -> list[str]:
        widths = [max(len(str(row[i])) for row in [COLUMNS, *map(_figures, self.ranked)]) for i in range(len(COLUMNS))]
        out = [f"{len(self.measured)} candidates ({self.search} search{', stopped early' if self.interrupted else ''})"
               f": {self.title}"]  # fmt: skip
        out += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                for row in [COLUMNS, *map(_figures, self.ranked)]]  # fmt: skip
        front = pareto_front(self.measured)
        out.append("throughput-p99 front: " + "; ".join(
            f"{m.candidate.label} ({m.best.throughput:.1f} req/s, p99 {m.best.latency_ms['p99']:.2f} ms)" for m in front
        ))  # fmt: skip
        chosen, defaults = self.chosen, self.defaults
        if self.confirmation_line():
            out.append(self.confirmation_line())
        if chosen is None:
            closest = self.ranked[0]
            near = "" if closest.failed or closest.best is None else (
                f"; the closest, {closest.candidate.label}, {closest.miss:.2f} times its target at "
                f"{closest.best.point.label}"
            )  # fmt: skip
            out.append(f"no candidate held every SLO: the settings cannot meet it here at this load{near}")
            return out
        against = ""
        if defaults is not None and defaults.best is not None and chosen is not defaults:
            ratio = chosen.best.throughput / defaults.best.throughput if defaults.best.throughput else float("inf")
            held = "held" if defaults.held else "missed"
            against = (f" against the defaults' {defaults.best.throughput:.1f} req/s ({ratio:.2f}x; the defaults "
                       f"{held} the SLO)")  # fmt: skip
        if not chosen.candidate.changed:
            side = [d.best.throughput for d, _ in self.confirmation or () if d.held]
            if chosen.held:
                measured_as = f"; {statistics.median(side):.1f} in the side-by-side rounds (median)" if side else ""
                out.append(f"best: the defaults, {chosen.best.throughput:.1f} req/s within the SLO{measured_as}")
            else:  # they missed it in the search, and held it in the rounds more often than the leader
                out.append(f"best: the defaults, {statistics.median(side):.1f} req/s within the SLO in the "
                           f"{len(side)} side-by-side rounds they held it (median)")  # fmt: skip
        else:
            out.append(f"best: {chosen.candidate.label}, {chosen.best.throughput:.1f} req/s within the SLO{against}")
        out.append(f"serve it: {self.serve_command(chosen)}")
        return out

    def write_env(self, path: Path) -> None:
        """The chosen setting as MHASERVE_* lines (a shell, docker compose's .env and systemd read them)."""
        chosen = self.chosen
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        lines = [f"# mhaserve tune, {stamp}: {self.title}"]
        if chosen is None:
            lines.append("# no candidate held every SLO: nothing to set")
        else:
            lines.append(f"# {chosen.best.throughput:.1f} req/s, p99 {chosen.best.latency_ms['p99']:.2f} ms at "
                         f"{chosen.best.point.label}; serve it: {self.serve_command(chosen)}")  # fmt: skip
            if not chosen.candidate.changed:
                lines.append("# the defaults were best: nothing to set")
            for name, value in chosen.candidate.changed:
                lines.append(f"MHASERVE_{name.upper()}={setting_text(value)}")
        path.write_text("\n".join(lines) + "\n")

    def as_json(self) -> dict:
        chosen = self.chosen
        return {
            "title": self.title,
            "command": self.command,
            "search": self.search,
            "stopped_early": self.interrupted,
            "slo": [s.text for s in self.slos],
            "chosen": dict(chosen.candidate.changed) if chosen else None,
            "confirmation": [
                {
                    "defaults": d.best.row() if d.best else None,
                    "best": b.best.row() if b.best else None,
                    "defaults_held": d.held,
                    "best_held": b.held,
                    "best_won": better(b, d),
                }
                for d, b in self.confirmation or []
            ],  # fmt: skip
            "front": [m.candidate.label for m in pareto_front(self.measured)],
            "candidates": [
                {
                    "setting": dict(m.candidate.changed),
                    "flags": m.candidate.flags(),
                    "failed": m.failed or None,
                    "held": m.held,
                    "peak_rss_mib": m.peak_rss_mib,
                    "seconds": round(m.seconds, 1),
                    "points": [p.row() | {"slo_held": ok} for p, ok in zip(m.points, m.verdicts, strict=True)],
                }
                for m in self.measured
            ],
        }

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.as_json(), indent=1, default=str) + "\n")

    def plot_png(self) -> bytes:
        figure = self.plot_figure()  # chooses matplotlib's Agg backend before pyplot is imported here
        import matplotlib.pyplot as plt

        from .report import _png

        return _png(figure, plt)

    def plot_figure(self):
        """Each candidate's best point, throughput against p99, numbered as the report's table ranks it; the front
        joined, the chosen ringed, latency SLOs drawn. The legend names only what is drawn."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        number = {id(m): n for n, m in enumerate(self.ranked, 1)}
        scored = [m for m in self.measured if m.best is not None and not m.failed]
        fig, ax = plt.subplots(figsize=(8, 5))
        for held, colour, label in ((True, "#176b2c", "SLO held"), (False, "#b00020", "SLO missed")):
            group = [m for m in scored if m.held == held]
            if group:
                ax.scatter([m.best.latency_ms["p99"] for m in group], [m.best.throughput for m in group], c=colour,
                           label=label, zorder=3)  # fmt: skip
        for m in scored:
            ax.annotate(str(number[id(m)]), (m.best.latency_ms["p99"], m.best.throughput), xytext=(4, 4),
                        textcoords="offset points", fontsize=8)  # fmt: skip
        front = sorted(pareto_front(self.measured), key=lambda m: m.best.latency_ms["p99"])
        if len(front) > 1:
            ax.plot([m.best.latency_ms["p99"] for m in front], [m.best.throughput for m in front], "--", c="#555",
                    label="throughput-p99 front", zorder=2)  # fmt: skip
        if self.chosen is not None:
            ax.scatter([self.chosen.best.latency_ms["p99"]], [self.chosen.best.throughput], s=240, facecolors="none",
                       edgecolors="black", label=f"chosen: {self.chosen.candidate.label}", zorder=4)  # fmt: skip
        for slo in self.slos:
            if slo.metric == "p99":
                ax.axvline(slo.limit, c="#b00020", ls=":", label=f"SLO {slo.text}")
            elif slo.metric == "throughput":
                ax.axhline(slo.limit, c="#b00020", ls="-.", label=f"SLO {slo.text}")
        ax.set_xlabel("p99 latency (ms)")
        ax.set_ylabel("throughput (requests/s)")
        ax.set_title(self.title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        return fig

    def verdict_lines(self) -> list[str]:
        """The lines after the table, as the command prints them: the front, the side-by-side rounds, the verdict."""
        return self.lines()[len(self.measured) + 2 :]

    def write_html(self, path: Path) -> None:
        from .report import _STYLE

        rows = "".join(
            f"<tr><td>{n}</td>" + "".join(
                f'<td class="text">{html.escape(v)}</td>' if i in (0, 5, 7) else f"<td>{html.escape(v)}</td>"
                for i, v in enumerate(_figures(m))
            ) + "</tr>"
            for n, m in enumerate(self.ranked, 1)
        )  # fmt: skip
        chosen = self.chosen
        verdict = (
            f'<div class="verdict pass">best: {html.escape(chosen.candidate.label)}, {chosen.best.throughput:.1f} '
            f"req/s within the SLO</div>"
            if chosen is not None
            else '<div class="verdict fail">no candidate held every SLO</div>'
        )
        said = "".join(f"<li>{html.escape(line)}</li>" for line in self.verdict_lines())
        header = "<th>#</th>" + "".join(f'<th class="text">{c}</th>' if i in (0, 5, 7) else f"<th>{c}</th>"
                                        for i, c in enumerate(COLUMNS))  # fmt: skip
        png = base64.b64encode(self.plot_png()).decode()
        document = (
            f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>mhaserve tune</title>'
            f"<style>{_STYLE}</style></head><body><h1>mhaserve tune</h1><p>{html.escape(self.title)}</p>{verdict}"
            f'<ul class="said">{said}</ul><p><code>{html.escape(" ".join(self.command))}</code></p>'
            f"<h2>Candidates ({self.search} search{', stopped early' if self.interrupted else ''})</h2>"
            f"<table><tr>{header}</tr>{rows}</table>"
            f"<h2>Throughput against p99</h2><p>Each dot is a candidate, numbered as the table ranks it.</p>"
            f'<p><img alt="throughput against p99" src="data:image/png;base64,{png}"></p></body></html>\n'
        )
        path.write_text(document)
