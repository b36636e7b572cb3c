"""Live parity's effect on a caller's slowest requests on a busy host: one caller's latency against a server
checking every answer it can (--parity-share) beside one checking none, and, with --baseline, beside a server of
another revision checking the same share, side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_parity_tail.py [--share 1] [--busy 2] [--baseline REV]

Each server serves the embedded default model (512/8); ``--busy`` processes spin on the cores meanwhile (the host's
other work), so that the checks, at the lowest priority, are kept off the cores while requests are answered. One
caller sends `[1, --length, 512]` with the weights to each server in turn, ``--seconds`` a round, in alternating
order from round to round; printed per server: the requests answered, p50, p99, p99.9, the slowest, and how many
took over 50 ms, pooled over the rounds. Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
import time

import numpy as np
from bench_revisions import baseline_checkout

from mhaserve.client.grpc import Client
from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.process import ServerProcess

SPIN = "while True: pass"
SLOW_MS = 50  # requests slower than this are counted: the slowest one alone is noisy


def latencies(server: ServerProcess, query: np.ndarray, seconds: float) -> list[float]:
    with Client(server.url) as client:
        for _ in range(20):
            client.infer(query)
        taken, until = [], time.perf_counter() + seconds
        while time.perf_counter() < until:
            started = time.perf_counter()
            client.infer(query)
            taken.append(time.perf_counter() - started)
    return taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--share", default="1", help="the checking servers' --parity-share")
    parser.add_argument("--baseline", help="a revision whose server checks the same share, measured beside")
    parser.add_argument("--busy", type=int, default=2, help="processes spinning on the cores meanwhile")
    parser.add_argument("--length", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=6.0)
    args = parser.parse_args()
    model_dir = ensure_default_model()
    query = np.random.default_rng(0).standard_normal((1, args.length, 512), dtype=np.float32)
    checking = ("--parity-share", args.share)
    with contextlib.ExitStack() as stack:
        servers = {"checking none": stack.enter_context(ServerProcess(model_dir)),
                   f"checking {args.share}": stack.enter_context(ServerProcess(model_dir, *checking))}  # fmt: skip
        if args.baseline:
            env, _ = stack.enter_context(baseline_checkout(args.baseline))
            servers[f"checking {args.share} at {args.baseline}"] = stack.enter_context(
                ServerProcess(model_dir, *checking, env=env)
            )
        spinning = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.busy)]
        stack.callback(lambda: [process.kill() for process in spinning])
        taken: dict[str, list[float]] = {name: [] for name in servers}
        for round_number in range(args.rounds):
            order = list(servers.items())
            for name, server in order if round_number % 2 == 0 else reversed(order):
                taken[name] += latencies(server, query, args.seconds)
    print(f"[1,{args.length},512] one caller, {args.busy} processes spinning, {args.rounds} rounds of "
          f"{args.seconds:g} s: ms")  # fmt: skip
    for name, each in taken.items():
        ms = np.sort(np.array(each)) * 1000
        at = {q: ms[min(len(ms) - 1, int(len(ms) * q))] for q in (0.5, 0.99, 0.999)}
        print(f"  {name:<32} n={len(ms):>6}  p50 {at[0.5]:7.2f}  p99 {at[0.99]:7.2f}  p99.9 {at[0.999]:7.2f}  "
              f"slowest {ms[-1]:7.2f}  over {SLOW_MS} ms: {int(np.sum(ms > SLOW_MS))}")  # fmt: skip


if __name__ == "__main__":
    main()
