"""What ``mhaserve bench`` shows and writes: a terminal table, JSON or CSV, PNG plots, and one HTML report."""

from __future__ import annotations

import base64
import csv
import html
import io
import itertools
import json
from pathlib import Path

from .loadgen import PointResult
from .server_side import SPLIT_FIELDS
from .slo import LATENCIES, summary

COLUMNS = ("load", "req/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "p99.9 ms", "max ms", "errors", "client cpu")


def table_header() -> str:
    return "  ".join(f"{c:>15}" if i == 0 else f"{c:>9}" for i, c in enumerate(COLUMNS))


def row_cells(r: PointResult) -> list[str]:
    """A point's figures as the table shows them, one per column ("!" marks a client-bound point)."""
    lat = r.latency_ms
    errors = ",".join(f"{k}:{v}" for k, v in sorted(r.errors.items())) or "0"
    cells = [r.point.label, f"{r.throughput:.1f}", *(f"{lat[k]:.3f}" for k in ("p50", "p90", "p95", "p99", "p99.9",
             "max")), errors]  # fmt: skip
    return [*cells, f"{r.client_cpu_cores:8.2f}c" + ("!" if r.client_bound else " ")]


def table_row(r: PointResult) -> str:
    return "  ".join(f"{c:>15}" if i == 0 else f"{c:>9}" for i, c in enumerate(row_cells(r)))


def notes(results: list[PointResult]) -> list[str]:
    lines = []
    if any(r.client_bound for r in results):
        lines.append(
            "! client-bound: a client process used most of a core (or an open-loop send left >50 ms late); "
            "those points measure the client too. Use more --processes or run the client elsewhere."
        )
    for r in results:
        for status, latency in sorted(r.error_latency_ms.items()):
            said = r.error_details.get(status)
            lines.append(
                f"{r.point.label}: {r.errors[status]} {status} answered in p50 {latency['p50']:.3f} ms, "
                f"p99 {latency['p99']:.3f} ms, max {latency['max']:.3f} ms"
                + (f"; the first said: {said}" if said else "")
            )
    for r in results:
        if r.server is not None:
            lines.append(server_line(r))
        elif r.server_unread is not None:
            lines.append(f"server side at {r.point.label}: not read, {r.server_unread}")
    for r in results:
        if r.by_position is not None:
            lines.append(position_line(r))
    dropped = sum(r.dropped for r in results)
    if dropped:
        lines.append(f"! open loop: {dropped} sends skipped with too many requests outstanding (server overloaded)")
    return lines


def server_line(r: PointResult) -> str:
    """The server's side of a point, per request: its time, of which queue and compute, and the rest."""
    s = r.server
    rest = s["transport_and_client_ms"]
    rows = f"; {s['rows_per_run']:.1f} rows per run" if s["rows_per_run"] is not None else ""
    return (
        f"server side at {r.point.label}: {s['server_ms']:.3f} ms a request ({s['requests']} requests): queue "
        f"{s['queue_ms']:.3f}, compute input {s['compute_input_ms']:.3f}, infer {s['compute_infer_ms']:.3f}, "
        f"output {s['compute_output_ms']:.3f}"
        + (f"; transport and client {rest:.3f} ms (of the mean)" if rest is not None else "")
        + rows
    )


def position_line(r: PointResult) -> str:
    """How a sequence step's latency grows with its position, per range of positions."""
    ranges = "; ".join(
        f"{positions} p50 {f['p50']:.3f} p99 {f['p99']:.3f} ms ({f['steps']} steps)" if f["steps"] else
        f"{positions}: no steps"
        for positions, f in r.by_position.items()
    )  # fmt: skip
    return f"steps at {r.point.label} by position: {ranges}"


def run_metadata(command: list[str], model: dict) -> dict:
    """What was run, where and when: the UTC date, mhaserve's version (and git revision in a checkout), the
    client's host, the command line, and the model as the server described it."""
    import datetime
    import os
    import platform
    import subprocess

    import mhaserve
    from mhaserve.contract.cpu import cpu_model

    checkout = Path(mhaserve.__file__).resolve().parents[1]
    try:
        revision = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                                  text=True, timeout=5).stdout.strip() or None  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        revision = None
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "mhaserve": mhaserve.__version__,
        "git_revision": revision,
        "client_host": {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version()},
        "command": command,
        "model": model,
    }


def write_json(results: list[PointResult], path: Path, meta: dict, extra: list[dict] | None = None) -> None:
    """The run's metadata and a record per point (with ``extra``'s fields per point: SLO verdicts, goodput)."""
    points = [{**r.row(), **(extra[i] if extra else {})} for i, r in enumerate(results)]
    path.write_text(json.dumps({"meta": meta, "points": points}, indent=2) + "\n")


def write_csv(results: list[PointResult], path: Path) -> None:
    rows = [r.row() for r in results]
    for row in rows:
        row["errors_by_status"] = ";".join(f"{k}:{v}" for k, v in sorted(row["errors_by_status"].items()))
        row["error_latency_ms"] = ";".join(
            f"{k}:p50={v['p50']:.3f},p99={v['p99']:.3f}" for k, v in sorted(row["error_latency_ms"].items())
        )
        row["error_details"] = json.dumps(row["error_details"]) if row["error_details"] else ""
        row.pop("rounds")
        row["by_position"] = json.dumps(row["by_position"]) if row["by_position"] else ""
        server = row.pop("server") or {}
        row.update({f"server_{key}": server.get(key) for key in SPLIT_FIELDS})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


PLOTS = ("latency_percentiles.png", "latency_histogram.png")


def plot(results: list[PointResult], out_dir: Path, title: str, slos=()) -> list[Path]:
    """The plots as PNG files in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, png in zip(PLOTS, plot_images(results, title, slos), strict=True):
        written.append(out_dir / name)
        written[-1].write_bytes(png)
    return written


# One line style per SLO, in the order given, so that two lines of one colour still read apart.
_SLO_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


def plot_images(results: list[PointResult], title: str, slos=()) -> list[bytes]:
    """Latency percentiles against throughput and against load, and a latency histogram per point (PNG bytes);
    each SLO (slo.Slo) drawn where it applies: a latency target across both percentile plots and the histogram,
    a throughput target up the plot by throughput."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    images = [_png(percentile_figure(results, title, slos), plt)]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    finite = [r for r in results if r.latencies_ms.size]
    if finite:
        low = max(min(r.latencies_ms.min() for r in finite), 1e-3)
        high = max(r.latencies_ms.max() for r in finite)
        bins = np.geomspace(low, high * 1.01, 60)
        for r in finite:
            ax.hist(r.latencies_ms, bins=bins, histtype="step", label=r.point.label)
        ax.set_xscale("log")
    slowest = max((r.latencies_ms.max() for r in finite), default=0.0)
    for slo, style in zip(slos, itertools.cycle(_SLO_STYLES), strict=False):
        if slo.metric in LATENCIES and finite and slo.limit > 3 * slowest:  # named, not drawn (as above)
            ax.plot([], [], color="#b00020", linestyle=style, label=f"SLO {slo.text} (beyond the slowest)")
        elif slo.metric in LATENCIES:
            ax.axvline(slo.limit, color="#b00020", linestyle=style, label=f"SLO {slo.text}")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("requests")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    images.append(_png(fig, plt))
    return images


def percentile_figure(results: list[PointResult], title: str, slos=()):
    """Latency percentiles against throughput and against load, as a matplotlib figure: the usual percentiles and
    every one an SLO names, each latency SLO drawn in its percentile's colour, each SLO in a line style of its own."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xlabel = "concurrency" if results[0].point.mode == "closed" else "offered rate (req/s)"
    fig, (by_throughput, by_load) = plt.subplots(1, 2, figsize=(12, 4.5))
    # The usual percentiles, and every one an SLO names: each SLO is drawn on its own percentile's curve.
    asked = [slo.metric for slo in slos if slo.metric in LATENCIES]
    colour = {}
    for q in [q for q in (*LATENCIES, "max") if q in {"p50", "p90", "p99", "max", *asked}]:
        ys = [r.latency_ms[q] for r in results]
        (line,) = by_throughput.plot([r.throughput for r in results], ys, marker="o", label=q)
        by_load.plot([r.point.load for r in results], ys, marker="o", label=q, color=line.get_color())
        colour[q] = line.get_color()
    by_throughput.set_xlabel("throughput (req/s)")
    by_load.set_xlabel(xlabel)
    if results[0].point.mode == "closed" and len(results) > 1:
        by_load.set_xscale("log", base=2)
    highest = max(r.latency_ms[q] for r in results for q in colour)
    for slo, style in zip(slos, itertools.cycle(_SLO_STYLES), strict=False):
        if slo.metric == "throughput":
            by_throughput.axvline(slo.limit, color="#b00020", linestyle=style, label=f"SLO {slo.text}")
        elif slo.metric in LATENCIES:
            line = {"color": colour[slo.metric], "linestyle": style, "linewidth": 1.5}
            for ax in (by_throughput, by_load):
                if slo.limit > 3 * highest:  # drawn, it would squash the curves to the floor: named only
                    ax.plot([], [], **line, label=f"SLO {slo.text} (the {slo.metric} curve, above the plot)")
                else:
                    ax.axhline(slo.limit, **line, label=f"SLO {slo.text} (the {slo.metric} curve)")
    for ax in (by_throughput, by_load):
        ax.set_ylabel("latency (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _png(fig, plt) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1200px; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: right; }
th { background: #f3f3f3; } td.text, th.text { text-align: left; }
.held { color: #176b2c; } .missed { color: #b00020; font-weight: bold; }
.verdict { padding: 0.6em 1em; border-radius: 4px; font-size: 1.2em; font-weight: bold; color: white; }
.verdict.pass { background: #176b2c; } .verdict.fail { background: #b00020; }
.verdict ul { margin: 0.3em 0 0; font-size: 0.8em; font-weight: normal; }
img { max-width: 100%; } code { background: #f3f3f3; padding: 0 0.2em; }
"""


def write_html(results: list[PointResult], path: Path, meta: dict, judged: list[dict], title: str, slos=()) -> None:
    """One self-contained file: the verdict (PASS or FAIL per SLO and for the run), what was run, the table with
    each point's SLO verdicts, the server's side of each point, the rounds' spread and the plots with the SLOs
    drawn, embedded; nothing is fetched when it is opened."""
    parts = [f"<h1>mhaserve bench</h1><p>{html.escape(title)}</p>"]
    if slos:
        parts.append(_verdict_html(results, slos))
    parts.append(_run_html(meta))
    parts.append("<h2>Points</h2>" + _table(COLUMNS, [[c.strip() for c in row_cells(r)] for r in results]))
    if any(v["slo"] for v in judged):
        parts.append(_slo_html(results, judged))
    parts.append(_server_side_html(results))
    if "parity" in meta:
        from .server_side import parity_line

        parts.append(f"<h2>Live parity</h2><p>{html.escape(parity_line(meta['parity']))}</p>")
    grown = [r for r in results if r.by_position]
    if grown:
        parts.append("<h2>Sequence steps by position</h2><ul>" + "".join(
            f"<li>{html.escape(position_line(r))}</li>" for r in grown) + "</ul>")  # fmt: skip
    spread = [r for r in results if r.rounds]
    if spread:
        from .rounds import rounds_line

        parts.append("<h2>Rounds</h2><ul>" + "".join(f"<li>{html.escape(rounds_line(r))}</li>" for r in spread)
                     + "</ul>")  # fmt: skip
    parts.append("<h2>Plots</h2>" + "".join(
        f'<p><img alt="{name}" src="data:image/png;base64,{base64.b64encode(png).decode()}"></p>'
        for name, png in zip(PLOTS, plot_images(results, title, slos), strict=True)
    ))  # fmt: skip
    document = (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{_STYLE}</style></head><body>{''.join(parts)}</body></html>\n"
    )
    path.write_text(document)


def _cells(values, tag="td") -> str:
    return "".join(
        f'<{tag} class="text">{html.escape(str(v))}</{tag}>' if isinstance(v, str) and i == 0
        else f"<{tag}>{html.escape(str(v))}</{tag}>"
        for i, v in enumerate(values)
    )  # fmt: skip


def _table(header, rows) -> str:
    body = "".join(f"<tr>{_cells(row)}</tr>" for row in rows)
    return f"<table><tr>{_cells(header, 'th')}</tr>{body}</table>"


def _verdict_html(results: list[PointResult], slos) -> str:
    """PASS or FAIL for the run, and each SLO's worst point."""
    summarised = summary(results, list(slos))
    passed = all(s["passed"] for s in summarised)
    return (
        f'<div class="verdict {"pass" if passed else "fail"}">{"PASS" if passed else "FAIL"}: '
        f"{sum(s['passed'] for s in summarised)} of {len(summarised)} SLOs held at every point<ul>"
        + "".join(
            f"<li>{'PASS' if s['passed'] else 'FAIL'} {html.escape(s['slo'])} (worst: "
            f"{html.escape(s['worst'])} at {html.escape(s['at'])})</li>"
            for s in summarised
        )
        + "</ul></div>"
    )


def _run_html(meta: dict) -> str:
    """What was run: when, which mhaserve, the command, the client host, the model and how it was served."""
    model = meta.get("model") or {}

    def listed(value) -> str:
        return ", ".join(map(str, value)) if isinstance(value, list) else str(value)

    about = [
        ("date (UTC)", meta.get("date_utc")),
        ("mhaserve", f"{meta.get('mhaserve')}" + (f" ({meta['git_revision']})" if meta.get("git_revision") else "")),
        ("command", " ".join(meta.get("command") or [])),
        ("client host", ", ".join(f"{k} {v}" for k, v in (meta.get("client_host") or {}).items())),
        ("client processes", meta.get("processes")),
        ("model", ", ".join(f"{k} {listed(v)}" for k, v in model.items() if k != "served_with")),
        ("served with", ", ".join(f"{k}={v}" for k, v in (model.get("served_with") or {}).items())),
        ("SLO", ", ".join(meta.get("slo") or []) or "none"),
    ]
    return '<h2>The run</h2><table>' + "".join(
        f'<tr><th class="text">{html.escape(k)}</th><td class="text"><code>{html.escape(str(v))}</code></td></tr>'
        for k, v in about
    ) + "</table>"  # fmt: skip


def _slo_html(results: list[PointResult], judged: list[dict]) -> str:
    """Each point's SLO verdicts and goodput."""
    verdicts = []
    for r, verdict in zip(results, judged, strict=True):
        held = " ".join(
            f'<span class="{"held" if v["held"] else "missed"}">{html.escape(v["slo"])} '
            f"{'held' if v['held'] else 'MISSED'} ({html.escape(str(v['observed']))})</span>;"
            for v in verdict["slo"]
        )
        good = verdict["goodput_per_s"]
        verdicts.append(
            f'<tr><td class="text">{html.escape(r.point.label)}</td><td class="text">{held}</td>'
            f"<td>{'' if good is None else f'{good:.1f}'}</td></tr>"
        )
    return (
        '<h2>SLO</h2><table><tr><th class="text">load</th><th class="text">targets</th><th>goodput /s</th></tr>'
        + "".join(verdicts) + "</table>"
    )  # fmt: skip


def _server_side_html(results: list[PointResult]) -> str:
    """The server's statistics over each point's window, and the points where they could not be read."""
    parts = []
    split = [r for r in results if r.server is not None]
    if split:
        header = ("load", "requests", "server ms", "queue ms", "compute input ms", "compute infer ms",
                  "compute output ms", "transport and client ms", "rows per run")  # fmt: skip

        def number(value, digits=3) -> str:
            return "" if value is None else f"{value:.{digits}f}"

        parts.append("<h2>The server's side (per request, the server's statistics over each window)</h2>" + _table(
            header,
            [[r.point.label, r.server["requests"], *(number(r.server[k]) for k in ("server_ms", "queue_ms",
              "compute_input_ms", "compute_infer_ms", "compute_output_ms", "transport_and_client_ms")),
              number(r.server["rows_per_run"], 1)] for r in split],
        ))  # fmt: skip
    unread = [r for r in results if r.server is None and r.server_unread is not None]
    if unread:
        parts.append("<ul>" + "".join(f"<li>The server's side at {html.escape(r.point.label)}: not read, "
                                      f"{html.escape(r.server_unread)}</li>" for r in unread) + "</ul>")  # fmt: skip
    return "".join(parts)
