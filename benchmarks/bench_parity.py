"""Live parity's cost: a server checking a share of its answers (--parity-share) beside one checking none, side by
side in one run, at the usual points, as benchmarks/bench_revisions.py compares two revisions.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_parity.py [--share 0.01] [--rounds 5] [--duration 5]

Both serve the embedded default model (512/8) from the working tree. Printed per point and round: each server's
requests/s, p50, p99 and CPU-seconds per 1,000 requests, the ratios and their medians; then the checks the
checking server made, breached and dropped (its /metrics). Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import urllib.request

from bench_revisions import POINTS, add_round_arguments, compare

from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--share", type=float, default=0.01, help="the checking server's --parity-share")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--rate", type=float, default=None)
    add_round_arguments(parser, ",".join(f"{length}x{c}" for length, c in POINTS))
    args = parser.parse_args()
    model_dir = ensure_default_model()
    with ServerProcess(model_dir) as unchecked, ServerProcess(model_dir, "--parity-share", str(args.share)) as checked:
        print(f"baseline: --parity-share 0; current: --parity-share {args.share}")
        compare(unchecked, checked, args)
        with urllib.request.urlopen(checked.metrics_url, timeout=10) as response:
            lines = response.read().decode().splitlines()
        print("\n".join(line for line in lines if line.startswith("mhaserve_parity_checks_total")))


if __name__ == "__main__":
    main()
