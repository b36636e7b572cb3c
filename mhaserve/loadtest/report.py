"""What ``mhaserve bench`` shows and writes: a terminal table, JSON or CSV, and PNG plots."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .loadgen import PointResult
from .server_side import SPLIT_FIELDS

COLUMNS = ("load", "req/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "p99.9 ms", "max ms", "errors", "client cpu")


def table_header() -> str:
    return "  ".join(f"{c:>15}" if i == 0 else f"{c:>9}" for i, c in enumerate(COLUMNS))


def table_row(r: PointResult) -> str:
    lat = r.latency_ms
    errors = ",".join(f"{k}:{v}" for k, v in sorted(r.errors.items())) or "0"
    cells = [f"{r.point.label:>15}", f"{r.throughput:9.1f}"]
    cells += [f"{lat[k]:9.3f}" for k in ("p50", "p90", "p95", "p99", "p99.9", "max")]
    cells += [f"{errors:>9}", f"{r.client_cpu_cores:8.2f}c" + ("!" if r.client_bound else " ")]
    return "  ".join(cells)


def notes(results: list[PointResult]) -> list[str]:
    lines = []
    if any(r.client_bound for r in results):
        lines.append(
            "! client-bound: a client process used most of a core (or an open-loop send left >50 ms late); "
            "those points measure the client too. Use more --processes or run the client elsewhere."
        )
    for r in results:
        for status, latency in sorted(r.error_latency_ms.items()):
            lines.append(
                f"{r.point.label}: {r.errors[status]} {status} answered in p50 {latency['p50']:.3f} ms, "
                f"p99 {latency['p99']:.3f} ms, max {latency['max']:.3f} ms"
            )
    for r in results:
        if r.server is not None:
            lines.append(server_line(r))
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
        row.pop("rounds")
        server = row.pop("server") or {}
        row.update({f"server_{key}": server.get(key) for key in SPLIT_FIELDS})
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(results: list[PointResult], out_dir: Path, title: str) -> list[Path]:
    """Latency percentiles against throughput and against load, and a latency histogram per point."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as missing:
        raise SystemExit("plots need matplotlib: pip install 'mhaserve[plot]'") from missing
    import numpy as np

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    xlabel = "concurrency" if results[0].point.mode == "closed" else "offered rate (req/s)"
    fig, (by_throughput, by_load) = plt.subplots(1, 2, figsize=(12, 4.5))
    for q in ("p50", "p90", "p99", "max"):
        ys = [r.latency_ms[q] for r in results]
        by_throughput.plot([r.throughput for r in results], ys, marker="o", label=q)
        by_load.plot([r.point.load for r in results], ys, marker="o", label=q)
    by_throughput.set_xlabel("throughput (req/s)")
    by_load.set_xlabel(xlabel)
    if results[0].point.mode == "closed" and len(results) > 1:
        by_load.set_xscale("log", base=2)
    for ax in (by_throughput, by_load):
        ax.set_ylabel("latency (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    written.append(out_dir / "latency_percentiles.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    finite = [r for r in results if r.latencies_ms.size]
    if finite:
        low = max(min(r.latencies_ms.min() for r in finite), 1e-3)
        high = max(r.latencies_ms.max() for r in finite)
        bins = np.geomspace(low, high * 1.01, 60)
        for r in finite:
            ax.hist(r.latencies_ms, bins=bins, histtype="step", label=r.point.label)
        ax.set_xscale("log")
    ax.set_xlabel("latency (ms)")
    ax.set_ylabel("requests")
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    written.append(out_dir / "latency_histogram.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written
