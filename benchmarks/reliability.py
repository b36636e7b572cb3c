"""The long forms of tests/test_reliability.py, with figures for the README's reliability section.

    .venv/bin/python benchmarks/reliability.py                     # 100k-request soak + overload, default model
    .venv/bin/python benchmarks/reliability.py --soak-requests 20000 --model-dir model_repository/mha

1. Soak: --soak-requests requests from --concurrency callers, lengths --lengths, a mix of
   self/cross-attention, masks and outputs; one answer in --check-every recomputed in process and
   compared; server RSS sampled after the first tenth (warm-up) and through the run.
2. Overload: a burst of --burst requests at once against a queue of --burst-queue, then an open-loop
   run at --overload-rate requests/s for --overload-seconds: refusals (RESOURCE_EXHAUSTED) against
   answers, their latencies, and every answer checked.
Client and server share this machine's cores; the client's own CPU time is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import resource
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from mhaserve.checked_load import Reference, Shapes, burst, make_call, mismatch, rss_mib, run_checked_load

SERVING = re.compile(r"serving model=.* address=([\d.]+):(\d+)")


class Server:
    def __init__(self, model_dir: Path, *args: str):
        self.command = [sys.executable, "-m", "mhaserve.cli", "serve", "--model-dir", str(model_dir),
                        "--port", "0", "--metrics-port", "-1", *args]  # fmt: skip

    def __enter__(self):
        self.proc = subprocess.Popen(self.command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for line in self.proc.stderr:
            match = SERVING.search(line)
            if match:
                self.url = f"{match.group(1)}:{match.group(2)}"
                return self
        raise RuntimeError(f"the server did not start (exit {self.proc.wait()})")

    def __exit__(self, *exc):
        self.proc.terminate()
        tail = self.proc.communicate(timeout=60)[1]
        print("  server: " + next((line for line in tail.splitlines() if "stopped:" in line), "(no stop line)"))


def client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="model folder (default: the embedded default model)")
    parser.add_argument("--soak-requests", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--lengths", default="16..128", help="MIN..MAX sequence lengths")
    parser.add_argument("--check-every", type=int, default=100)
    parser.add_argument("--burst", type=int, default=2000)
    parser.add_argument("--burst-queue", type=int, default=64)
    # Requests are made up front (about 0.3 MB each at 512 wide): rate x seconds of them must fit in memory.
    parser.add_argument("--overload-rate", type=float, default=300.0)
    parser.add_argument("--overload-seconds", type=float, default=10.0)
    args = parser.parse_args()

    from mhaserve.cli import ensure_default_model

    model_dir = args.model_dir or ensure_default_model()
    low, high = (int(x) for x in args.lengths.split(".."))
    reference = Reference(model_dir)
    d_model = reference.session.info.d_model
    shapes = Shapes(d_model, low, high)
    print(f"command: {' '.join(sys.argv)}")
    print(f"model {model_dir} (d_model {d_model}); lengths {low}..{high}; client and server on this machine")

    soak_ok = burst_ok = True  # a part given 0 requests is skipped
    print(f"\n1. soak: {args.soak_requests} requests, concurrency {args.concurrency}")
    with Server(model_dir) if args.soak_requests else nullcontext() as server:
        cpu = client_cpu_s()
        report = server and asyncio.run(
            run_checked_load(
                server.url,
                shapes,
                args.soak_requests,
                args.concurrency,
                reference=reference,
                check_every=args.check_every,
                rss=lambda: rss_mib(server.proc.pid),
            )
        )
        if report:
            print("  " + report.summary().replace("\n", "\n  "))
            print(f"  client CPU {client_cpu_s() - cpu:.0f} s over {report.elapsed_s:.0f} s")
            soak_ok = set(report.statuses) == {"OK"} and not report.mismatches

    print(f"\n2a. overload: a burst of {args.burst} requests at once, --max-queue-size {args.burst_queue}")
    rng = np.random.default_rng(1)
    with Server(model_dir, "--max-queue-size", str(args.burst_queue)) if args.burst else nullcontext() as server:
        calls = [make_call(rng, shapes) for _ in range(args.burst)] if server else []
        if server:
            report = asyncio.run(burst(server.url, calls, timeout_s=120))
            problems = [p for call in calls if call.status == "OK" and (p := mismatch(call, reference))]
            print("  " + report.summary().replace("\n", "\n  "))
            print(f"  every answer checked: {sum(c.status == 'OK' for c in calls)}, mismatches {len(problems)}")
            burst_ok = set(report.statuses) <= {"OK", "RESOURCE_EXHAUSTED"} and not problems

    count = int(args.overload_rate * args.overload_seconds)
    print(f"\n2b. overload: open loop at {args.overload_rate:g}/s for {args.overload_seconds:g} s ({count} requests), "
          f"--max-queue-size {args.burst_queue}")  # fmt: skip
    with Server(model_dir, "--max-queue-size", str(args.burst_queue)) as server:
        calls = [make_call(rng, shapes) for _ in range(count)]
        cpu, started = client_cpu_s(), time.perf_counter()
        report = asyncio.run(burst(server.url, calls, timeout_s=120, rate=args.overload_rate))
        wall = time.perf_counter() - started
        problems = [p for call in calls if call.status == "OK" and (p := mismatch(call, reference))]
        print("  " + report.summary().replace("\n", "\n  "))
        print(f"  every answer checked: {sum(c.status == 'OK' for c in calls)}, mismatches {len(problems)}")
        print(f"  client CPU {client_cpu_s() - cpu:.0f} s over {wall:.0f} s (the sender shares the cores)")
        open_ok = set(report.statuses) <= {"OK", "RESOURCE_EXHAUSTED"} and not problems

    print(f"\nsoak {'passed' if soak_ok else 'FAILED'}, burst {'passed' if burst_ok else 'FAILED'}, "
          f"open-loop overload {'passed' if open_ok else 'FAILED'}")  # fmt: skip
    return 0 if soak_ok and burst_ok and open_ok else 1


if __name__ == "__main__":
    sys.exit(main())
