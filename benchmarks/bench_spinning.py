"""ONNX Runtime's threads between runs: what ``--intra-op-spin-ms`` saves on a server of sparse traffic, and what it
costs under load.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_spinning.py [--spins=-1,0,1,5] [--gaps 100,20]
        [--points 16x1,16x16,128x16] [--rounds 3]

First, for each ``--intra-op-spin-ms`` value (-1: ONNX Runtime's own spin), a server of the embedded default model
(512/8, two ONNX Runtime threads) answers one ``[1,16,512]`` request every GAP ms for 5 s, one client: printed, the
server's CPU (cores, and ms per request) and the requests' p50. Then each value but the first served side by side
with the first at the points under load, rounds alternating the two (bench_revisions.py's comparison: requests/s,
p50, p99, the server's CPU per 1,000 requests, ratios). Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from bench_revisions import compare

from mhaserve.client.grpc import Client
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.checked_load import process_cpu_seconds
from mhaserve.loadtest.loadgen import default_processes
from mhaserve.server.process import ServerProcess

SECONDS = 5.0


def sparse(model_dir, spin_ms: float, gap_s: float) -> str:
    """One request every ``gap_s``: the server's CPU and the requests' p50."""
    query = np.random.default_rng(0).standard_normal((1, 16, 512), dtype=np.float32)
    with ServerProcess(model_dir, "--intra-op-threads", "2", "--intra-op-spin-ms", str(spin_ms)) as server:
        with Client(server.url) as client:
            for _ in range(10):
                client.infer(query)
            time.sleep(1.0)
            before, latencies = process_cpu_seconds(server.proc.pid), []
            ends = time.monotonic() + SECONDS
            while time.monotonic() < ends:
                time.sleep(gap_s)
                started = time.perf_counter()
                client.infer(query)
                latencies.append(time.perf_counter() - started)
            used = process_cpu_seconds(server.proc.pid) - before
    return (
        f"{used / SECONDS:5.2f} cores, {used / len(latencies) * 1e3:5.1f} ms of CPU a request, "
        f"p50 {statistics.median(latencies) * 1e3:5.2f} ms ({len(latencies)} requests)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spins", default="-1,0,1,5", help="--intra-op-spin-ms values; the first is the baseline")
    parser.add_argument("--gaps", default="100,20", help="ms between the sparse requests")
    parser.add_argument("--points", default="16x1,16x16,128x16", help="LENGTHxCONCURRENCY,... at [1, LENGTH, 512]")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--processes", type=int, default=default_processes())
    args = parser.parse_args()
    args.protocol, args.rate = "grpc", None  # what bench_revisions' comparison reads
    model_dir = ensure_default_model()
    spins = [float(spin) for spin in args.spins.split(",")]
    for gap in (float(gap) for gap in args.gaps.split(",")):
        print(f"one request every {gap:g} ms, {SECONDS:g} s:")
        for spin in spins:
            print(f"  --intra-op-spin-ms {spin:g}: {sparse(model_dir, spin, gap / 1000)}", flush=True)
    if not args.points:
        return
    baseline_flags = ("--intra-op-spin-ms", str(spins[0]))
    for spin in spins[1:]:
        print(f"\nunder load: --intra-op-spin-ms {spin:g} (current) against {spins[0]:g} (baseline)")
        with (
            ServerProcess(model_dir, *baseline_flags) as baseline,
            ServerProcess(model_dir, "--intra-op-spin-ms", str(spin)) as current,
        ):
            compare(baseline, current, args)


if __name__ == "__main__":
    main()
