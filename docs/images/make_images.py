"""The site's pictures, from real runs: a server of the embedded default model (512/8) on free local ports, then
`mhaserve infer --heatmap` (one head's attention over a causal 48-token sequence), a short `mhaserve bench`
sweep with `--plot-dir`, the sequence tutorial's own drawing block (one row a step), and the Grafana dashboard's
panels: each of its queries run on a real Prometheus that scraped the server through a load test of rising
concurrency and refused requests, drawn with matplotlib in the dashboard's layout (Grafana itself is not installed
where this runs; the queries, units and legends are the dashboard's). Run from a clone with the export and test
extras, with `prometheus` on PATH (tests/tools/install_prometheus.sh); the images are checked in.

    .venv/bin/python docs/images/make_images.py
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
TUTORIAL = HERE.parent / "tutorials" / "sequence.md"


def legend(template: str, labels: dict) -> str:
    return re.sub(r"\{\{(\w+)\}\}", lambda m: labels.get(m.group(1), ""), template) or "value"


def draw_dashboard(server, cli: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mhaserve.testing.prometheus import Prometheus, dashboard_queries

    load = [*cli, "bench", "--url", server.url, "--lengths", "16..128", "--warmup", "0"]
    with tempfile.TemporaryDirectory() as folder:
        target = server.metrics_url.removeprefix("http://").removesuffix("/metrics")
        prometheus = Prometheus(target, Path(folder), scrape_ms=1000)
        try:
            started = time.time()
            time.sleep(5)
            for concurrency in ("1", "4", "16"):
                subprocess.run([*load, "--concurrency", concurrency, "--duration", "25"], check=True,
                               capture_output=True)  # fmt: skip
            # Requests over --max-batch-size: refused with RESOURCE_EXHAUSTED, beside a few that are served.
            subprocess.run([*load, "--concurrency", "8", "--batch", "64", "--duration", "10"], capture_output=True)
            # 64 callers against a queue of 24: some shed (queue_full).
            subprocess.run([*load, "--concurrency", "64", "--duration", "10"], capture_output=True)
            time.sleep(10)
            end = time.time()
            scale = {"s": (1e3, "ms"), "bytes": (2.0**-20, "MiB"), "percentunit": (100.0, "%"), "reqps": (1, "/s")}
            panels = dashboard_queries("10s")
            rows = (len(panels) + 1) // 2
            figure, axes = plt.subplots(rows, 2, figsize=(13, 3.1 * rows))
            for ax in axes.flat[len(panels) :]:
                ax.set_visible(False)
            for ax, (panel, targets) in zip(axes.flat, panels, strict=False):
                factor, unit = scale.get(panel.get("fieldConfig", {}).get("defaults", {}).get("unit"), (1, ""))
                for target, expression in targets:
                    for series in prometheus.query_range(expression, started, end, 2):
                        seconds = [float(t) - started for t, _ in series["values"]]
                        values = [float(v) * factor for _, v in series["values"]]
                        ax.plot(seconds, values, label=legend(target.get("legendFormat", ""), series["metric"]))
                ax.set_title(panel["title"], fontsize=10)
                ax.set_ylabel(unit)
                ax.grid(True, alpha=0.3)
                if ax.has_data():
                    ax.legend(fontsize=7, loc="upper left")
            for ax in axes.flat[len(panels) - 2 : len(panels)]:
                ax.set_xlabel("seconds into the run")
            figure.suptitle(
                "deploy/grafana/mhaserve.json: concurrency 1, 4, 16 over lengths 16..128, then refusals, "
                "then 64 callers shed by a queue of 24"
            )
            figure.tight_layout()
            figure.savefig(HERE / "dashboard.png", dpi=80)
            plt.close(figure)
        finally:
            prometheus.stop()


def main() -> None:
    from mhaserve.export.default_model import ensure_default_model
    from mhaserve.server.process import ServerProcess

    # One answer in ten checked against float64 (live parity), for the dashboard's parity panel to show.
    # A queue of 24 sheds some of 64 callers, for the dashboard's shed panel to show.
    with ServerProcess(ensure_default_model(), "--warmup-runs", "1", "--parity-share", "0.1",
                       "--max-queue-size", "24") as server:  # fmt: skip
        cli = [sys.executable, "-m", "mhaserve.cli"]
        causal = HERE / "causal-48.npy"
        np.save(causal, np.tril(np.ones((1, 48, 48), dtype=bool)))
        subprocess.run([*cli, "infer", "--url", server.url, "--q-len", "48", "--mask", str(causal), "--heatmap",
                        str(HERE / "heatmap.png"), "--head", "3", "--seed", "7"], check=True)  # fmt: skip
        causal.unlink()
        subprocess.run([*cli, "bench", "--url", server.url, "--lengths", "16..128", "--concurrency", "1,4,16",
                        "--duration", "4", "--warmup", "1", "--plot-dir", str(HERE)], check=True)  # fmt: skip
        (drawing,) = [b for b in re.findall(r"```python\n(.*?)```", TUTORIAL.read_text(), re.S) if ".savefig(" in b]
        subprocess.run([sys.executable, "-c", drawing.replace("127.0.0.1:8001", server.url)], cwd=HERE, check=True)
        draw_dashboard(server, cli)
    for name in ("heatmap.png", "latency_percentiles.png", "latency_histogram.png", "sequence_attention.png",
                 "dashboard.png"):  # fmt: skip
        print(f"wrote {HERE / name} ({(HERE / name).stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
