"""`mhaserve bench`'s server side of each point against the server's own /metrics over the same window, and what
reading the statistics costs: a server of the embedded default model (512/8), bench's load generator.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_server_split.py [--duration 10] [--concurrency 1,4,16]

Per point, ``mhaserve bench --warmup 0`` (so its measured window is the whole run) with /metrics scraped just
before and just after it: the request, queue and compute-infer time per request and the rows per run from the
Prometheus counters' deltas, beside bench's figures from the statistics extension, with their ratio. Then the
cost of one statistics read (gRPC, median of 200), which bench makes twice a window. Not a test: BENCHMARKS.md
records the figures with this command.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mhaserve.client.grpc import Client
from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.process import ServerProcess

SUMS = {
    "server_ms": "mhaserve_inference_request_duration_seconds_sum",
    "queue_ms": "mhaserve_inference_queue_duration_seconds_sum",
    "compute_infer_ms": "mhaserve_inference_compute_infer_duration_seconds_sum",
}
REQUESTS = "mhaserve_inference_request_duration_seconds_count"
RUNS, ROWS = "mhaserve_inference_batch_size_count", "mhaserve_inference_batch_size_sum"


def scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("mhaserve_inference_") and not line.startswith("#"):
            name, value = line.split("{")[0], line.rsplit(" ", 1)[1]
            values[name] = values.get(name, 0.0) + float(value)
    return values


def from_metrics(before: dict, after: dict) -> dict:
    requests = after[REQUESTS] - before[REQUESTS]
    split = {name: (after[key] - before[key]) / requests * 1e3 for name, key in SUMS.items()}
    split["rows_per_run"] = (after[ROWS] - before[ROWS]) / (after[RUNS] - before[RUNS])
    split["requests"] = requests
    return split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--concurrency", default="1,4,16")
    args = parser.parse_args()
    with ServerProcess(ensure_default_model(), "--metrics-port", "0") as server, tempfile.TemporaryDirectory() as d:
        print(f"{'concurrency':>11} {'figure':>17} | {'bench':>9} {'/metrics':>9} | bench / metrics")
        for concurrency in args.concurrency.split(","):
            out = Path(d) / f"c{concurrency}.json"
            before = scrape(server.metrics_url)
            command = [sys.executable, "-m", "mhaserve.cli", "bench", "--url", server.url, "--concurrency",
                       concurrency, "--warmup", "0", "--duration", str(args.duration), "--json", str(out)]  # fmt: skip
            subprocess.run(command, check=True, capture_output=True, text=True)
            after = scrape(server.metrics_url)
            (point,) = json.loads(out.read_text())["points"]
            bench, metrics = point["server"], from_metrics(before, after)
            for figure in ("requests", *SUMS, "rows_per_run"):
                print(f"{concurrency:>11} {figure:>17} | {bench[figure]:9.3f} {metrics[figure]:9.3f} | "
                      f"{bench[figure] / metrics[figure]:.3f}")  # fmt: skip
        with Client(server.url) as client:
            times = []
            for _ in range(200):
                started = time.perf_counter()
                client.statistics(timeout=10)
                times.append((time.perf_counter() - started) * 1e3)
        read_ms = statistics.median(times)
        print(f"\none statistics read: {read_ms:.3f} ms (median of 200, idle server); two a window of "
              f"{args.duration:g} s: {2 * read_ms / (args.duration * 1e3):.1e} of it")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
