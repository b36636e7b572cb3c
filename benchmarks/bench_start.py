"""A server's start: how long ``mhaserve serve`` takes from its command to its serving line, with the run cost
fitted at warm-up against the one kept from an earlier start.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_start.py [--rounds 5] [-- SERVE_FLAGS...]

The embedded default model (512/8), its folder given (so no export is timed), and a cache folder of its own for
the run costs: a first start fits and keeps the run cost, then each round starts the server once with
``--run-cost-cache false`` (a fit at every start, as before the cache) and once reading what was kept, in
alternating order. Printed: each start's seconds, the medians and their ratio, and what each start's log said of
the run cost. Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench_batching import logged_run_cost

from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.process import ServerProcess


def started_in(model_dir, cache: str, *flags: str) -> tuple[float, str]:
    """Seconds from the command to the serving line, and the log's run cost line."""
    began = time.perf_counter()
    with ServerProcess(model_dir, "--drain-seconds", "0", *flags, env={"MHASERVE_CACHE": cache}) as server:
        seconds = time.perf_counter() - began
    return seconds, logged_run_cost(server) or "none"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("flags", nargs="*", help="flags every start gets (after --)")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    with tempfile.TemporaryDirectory() as cache:
        seconds, fit = started_in(model_dir, cache, *args.flags)
        print(f"first start, fitting and keeping: {seconds:.2f} s; {fit}")
        kept = os.listdir(os.path.join(cache, "run-costs"))
        print(f"kept: {kept}")
        times: dict[str, list[float]] = {"fit": [], "kept": []}
        for round_ in range(args.rounds):
            order = ["fit", "kept"] if round_ % 2 == 0 else ["kept", "fit"]
            for name in order:
                flags = [*args.flags, *(("--run-cost-cache", "false") if name == "fit" else ())]
                seconds, fit = started_in(model_dir, cache, *flags)
                times[name].append(seconds)
                print(f"round {round_ + 1} {name:4s} {seconds:.2f} s; {fit}")
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    spread = {name: f"{min(seconds):.2f}-{max(seconds):.2f}" for name, seconds in times.items()}
    print(
        f"median start: fitted {medians['fit']:.2f} s ({spread['fit']}), kept {medians['kept']:.2f} s "
        f"({spread['kept']}); kept / fitted {medians['kept'] / medians['fit']:.2f}"
    )


if __name__ == "__main__":
    main()
