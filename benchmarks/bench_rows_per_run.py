"""How full the server's model runs are under load, revision by revision: requests a second and rows a run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_rows_per_run.py b7536cc HEAD . [--runs 3]

Each revision (``.``: the working tree) serves the default model alone, in turn, and `mhaserve bench` drives it at
``[1,16,512]`` with 16 callers, ``--runs`` times for 4 s; printed per run: requests a second and the rows a model
run held (the server's statistics over the window, bench's "server side" line). Rows a run moves far less from
round to round than requests a second on a shared machine, so it finds a change in batching that throughput alone
hides in noise. Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import subprocess
import sys

from bench_revisions import revision_checkout

from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.process import ServerProcess


def measured(url: str, concurrency: int, length: int) -> tuple[float, float]:
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "bench", "--url", url, "--concurrency", str(concurrency),
         "--lengths", str(length), "--duration", "4", "--warmup", "1"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    throughput = float(re.search(rf"concurrency {concurrency}\s+([\d.]+)", done.stdout).group(1))
    rows = float(re.search(r"([\d.]+) rows per run", done.stdout).group(1))
    return throughput, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("revisions", nargs="+", help="revisions to serve in turn; '.' is the working tree")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--length", type=int, default=16)
    args = parser.parse_args()
    model_dir = ensure_default_model()
    for revision in args.revisions:
        with contextlib.ExitStack() as stack:
            env, _ = stack.enter_context(revision_checkout(None if revision == "." else revision))
            server = stack.enter_context(ServerProcess(model_dir, env=env))
            runs = [measured(server.url, args.concurrency, args.length) for _ in range(args.runs)]
        cells = ", ".join(f"{throughput:.0f}/s {rows:.1f} rows" for throughput, rows in runs)
        print(f"{revision:>10}: {cells}", flush=True)


if __name__ == "__main__":
    main()
