"""Another revision's server against the working tree's, loaded by tritonclient's own pattern, side by side.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_revisions_tritonclient.py --baseline REV [--rounds 5]
        [--points 16x16,128x16] [--seconds 5]

Both servers serve the embedded default model (512/8) with their defaults and stay up for the whole run (the
baseline from a temporary worktree, as benchmarks/bench_revisions.py does). The load is ../shared/peers/loadgen.py:
tritonclient.grpc threads in two client processes, each process's threads on one connection (gRPC shares it among
a process's channels to one address), every call synchronous and back to back, both outputs asked for. Each point
is measured on one server, then the other, the order alternating from round to round. Printed: requests/s per
round and the median ratio, working tree over baseline. Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench_revisions import baseline_checkout

from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.process import ServerProcess

LOADGEN = Path(__file__).resolve().parent.parent.parent / "shared" / "peers" / "loadgen.py"


def requests_per_s(url: str, length: int, concurrency: int, seconds: float) -> float:
    done = subprocess.run(
        [sys.executable, str(LOADGEN), "--url", url, "--model", "mha", "--input", "query",
         "--outputs", "output,attn_weights", "--shape", f"1,{length},512", "-c", str(concurrency), "--procs", "2",
         "--seconds", str(seconds), "--onnx", ""],
        capture_output=True, text=True, timeout=120, cwd=LOADGEN.parent, check=True,
    )  # fmt: skip
    return float(re.search(r"thr=\s*([\d.]+)/s", done.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--points", default="16x16,128x16", help="LENGTHxCONCURRENCY,... at [1, LENGTH, 512]")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    points = [tuple(map(int, point.split("x"))) for point in args.points.split(",")]
    model_dir = ensure_default_model()
    with (
        baseline_checkout(args.baseline) as (baseline_env, _),
        ServerProcess(model_dir, env=baseline_env) as baseline,
        ServerProcess(model_dir) as current,
    ):
        for length, concurrency in points:
            ratios = []
            for round_number in range(args.rounds):
                servers = [("baseline", baseline), ("current", current)]
                figures = {name: requests_per_s(server.url, length, concurrency, args.seconds)
                           for name, server in (servers if round_number % 2 == 0 else servers[::-1])}  # fmt: skip
                ratios.append(figures["current"] / figures["baseline"])
                print(f"[1,{length},512] c{concurrency} round {round_number + 1}: baseline {figures['baseline']:.1f}/s "
                      f"current {figures['current']:.1f}/s ratio {ratios[-1]:.2f}", flush=True)  # fmt: skip
            print(f"[1,{length},512] c{concurrency}: median ratio {statistics.median(ratios):.2f} "
                  f"({', '.join(f'{r:.2f}' for r in ratios)})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
