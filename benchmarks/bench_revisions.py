"""The served code of another revision against the working tree's, side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_revisions.py --baseline REV [--rounds 3] [--duration 8]
        [--current REV2]   # a second revision in place of the working tree: to bisect a change in speed

For a change meant to keep speed (a restructuring, a new check on the request path): REV is checked out into a
temporary worktree and served from there (the same virtual environment; ``PYTHONPATH`` puts that revision's
packages ahead of the working tree's editable install, Python 3.11 or newer), beside a server of the working
tree. Both serve the embedded default model (512/8) with the same arguments, and are up for the whole run; each
point is measured on one, then the other, in alternating order from round to round, with `mhaserve bench`'s
load generator (gRPC, or HTTP/REST with --protocol http; with the attention weights). Per point: requests/s,
p50 and p99 of each, the cores its clients took (they share the machine with the servers), the server's
CPU-seconds per 1,000 requests (less noisy than requests/s on a shared machine), the rows of each model run (the
batches the server formed, from its statistics), and the ratios of the working tree's figures to the baseline's, per
round and as the median. Not a test: BENCHMARKS.md records the
figures.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mhaserve.client.grpc import Client
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.checked_load import process_cpu_seconds as cpu_seconds
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload, default_processes
from mhaserve.loadtest.server_side import counters_of, split
from mhaserve.server.process import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
# The wheel's packages and the folders they come from (setup.py's PARTS).
PACKAGE_FOLDERS = {"model": "model", "export": "export", "server": "server", "protos": "protos"}
POINTS = [(16, 1), (16, 16), (128, 1), (128, 16)]  # (length, concurrency) at [1, L, 512]


def shadow_packages(checkout: Path, into: Path) -> Path:
    """A folder that, first on PYTHONPATH, makes ``import mhaserve`` load ``checkout``'s code."""
    package = into / "mhaserve"
    package.mkdir(parents=True)
    for entry in (checkout / "mhaserve").iterdir():
        (package / entry.name).symlink_to(entry)
    for name, folder in PACKAGE_FOLDERS.items():
        (package / name).symlink_to(checkout / folder)
    return into


def add_round_arguments(parser: argparse.ArgumentParser, points: str) -> None:
    """What a side-by-side measurement takes: rounds, each point's duration and warm-up, the load generator's
    processes, and the points."""
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--processes", type=int, default=default_processes())
    parser.add_argument("--points", default=points, help="LENGTHxCONCURRENCY,... at [1, LENGTH, 512]")


def parse_points(text: str) -> list[tuple[int, int]]:
    return [tuple(int(n) for n in point.split("x")) for point in text.split(",")]


@contextlib.contextmanager
def baseline_checkout(revision: str) -> Iterator[tuple[dict[str, str], Path]]:
    """``revision`` checked out into a temporary worktree: the environment under which a ServerProcess serves its
    code, and the worktree. Removed afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        checkout = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(checkout), revision],
                       check=True, capture_output=True)  # fmt: skip
        try:
            shadow = shadow_packages(checkout, Path(tmp) / "path")
            # PYTHONSAFEPATH: the working directory (this checkout) is not put ahead of PYTHONPATH
            yield {"PYTHONPATH": str(shadow), "PYTHONSAFEPATH": "1"}, checkout
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(checkout)], check=False)


@contextlib.contextmanager
def revision_checkout(revision: str | None) -> Iterator[tuple[dict[str, str] | None, Path]]:
    """``revision`` as baseline_checkout gives it, or the working tree where it is None."""
    if revision is None:
        yield None, ROOT
    else:
        with baseline_checkout(revision) as checked_out:
            yield checked_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--current", help="a revision to measure instead of the working tree (to bisect)")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--rate", type=float, help="an open loop at this many requests a second instead of the points' "
                        "callers: the same work for both, so the server's CPU per request compares alone")  # fmt: skip
    add_round_arguments(parser, ",".join(f"{length}x{c}" for length, c in POINTS))
    args = parser.parse_args()
    model_dir = ensure_default_model()
    with (
        baseline_checkout(args.baseline) as (baseline_env, checkout),
        revision_checkout(args.current) as (current_env, current_checkout),
        ServerProcess(model_dir, env=baseline_env) as baseline,
        ServerProcess(model_dir, env=current_env) as current,
    ):
        for server, expected in ((baseline, checkout), (current, current_checkout)):
            where = subprocess.run(
                [sys.executable, "-c", "import mhaserve.server as s; print(s.__path__[0])"],
                env=server.env, capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            assert Path(where).resolve() == (expected / "server").resolve(), (where, expected)
        compare(baseline, current, args)


def compare(baseline: ServerProcess, current: ServerProcess, args) -> None:
    columns = "req/s p50 p99 client-cores cpu-s/1k rows/run"
    print(f"{'point':>16} {'round':>5} | {'baseline ' + columns:>30} | {'current ' + columns:>30} | ratio")
    ratios: dict[tuple[int, int], list[float]] = {}
    cpu_ratios: dict[tuple[int, int], list[float]] = {}
    rows_seen: dict[tuple[int, int, str], list[float]] = {}
    points = parse_points(args.points)
    for round_number in range(args.rounds):
        order = [("baseline", baseline), ("current", current)]
        if round_number % 2:
            order.reverse()
        for length, concurrency in points:
            workload = Workload(512, 1, length, length, attn_weights=True, protocol=args.protocol)
            point = (
                Point("open", args.rate, args.duration, args.warmup)
                if args.rate
                else Point("closed", concurrency, args.duration, args.warmup)
            )
            results, cpu, rows = {}, {}, {}
            for name, server in order:
                url = server.url if args.protocol == "grpc" else server.http_url.removeprefix("http://")
                with LoadGenerator(url, args.processes) as generator:
                    before, counted = cpu_seconds(server.proc.pid), statistics_of(server)
                    results[name] = generator.measure(workload, point)
                    # the server's CPU over the point (warm-up included), per 1,000 requests measured
                    cpu[name] = (cpu_seconds(server.proc.pid) - before) / max(1, results[name].count) * 1000
                    rows[name] = (split(counted, statistics_of(server), None) or {}).get("rows_per_run") or 0.0
                    rows_seen.setdefault((length, concurrency, name), []).append(rows[name])
            ratio = results["current"].throughput / results["baseline"].throughput
            ratios.setdefault((length, concurrency), []).append(ratio)
            cpu_ratios.setdefault((length, concurrency), []).append(cpu["current"] / cpu["baseline"])
            cells = [
                f"{r.throughput:8.1f} {r.latency_ms['p50']:6.2f} {r.latency_ms['p99']:7.2f} {r.client_cpu_cores:5.2f} "
                f"{cpu[name]:6.2f} {rows[name]:5.2f}"
                for name, r in (("baseline", results["baseline"]), ("current", results["current"]))
            ]
            label = f"[1,{length:>3},512] c{concurrency:<3}"
            print(f"{label} {round_number + 1:>5} | {cells[0]} | {cells[1]} | {ratio:5.2f}", flush=True)
    print("\nmedian ratio, current / baseline: requests/s, and the server's CPU-seconds per 1,000 requests; "
          "median rows per run, baseline and current:")  # fmt: skip
    for key, values in ratios.items():
        length, concurrency = key
        rounds = ", ".join(f"{v:.2f}" for v in values)
        cpu_rounds = ", ".join(f"{v:.2f}" for v in cpu_ratios[key])
        print(f"[1,{length:>3},512] c{concurrency:<3} {statistics.median(values):.2f} ({rounds}); CPU "
              f"{statistics.median(cpu_ratios[key]):.2f} ({cpu_rounds}); rows per run "
              f"{statistics.median(rows_seen[(*key, 'baseline')]):.2f} and "
              f"{statistics.median(rows_seen[(*key, 'current')]):.2f}")  # fmt: skip


def statistics_of(server: ServerProcess) -> dict:
    """The server's statistics for the default model, as ``mhaserve bench`` reads them for its server side."""
    with Client(server.url) as client:
        return counters_of(client)()


if __name__ == "__main__":
    main()
