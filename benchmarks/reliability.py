"""The long forms of tests/integration/test_reliability.py, with figures for the README's reliability section.

    .venv/bin/python benchmarks/reliability.py                     # 100k-request soak + overload, default model
    .venv/bin/python benchmarks/reliability.py --soak-requests 20000 --model-dir model_repository/mha

1. Soak: --soak-requests requests from --concurrency callers, lengths --lengths, a mix of
   self/cross-attention, masks and outputs; one answer in --check-every recomputed in process and
   compared; server RSS sampled after the first tenth (warm-up) and through the run.
2. Overload: a burst of --burst requests at once against a queue of --burst-queue, then an open-loop
   run at --overload-rate requests/s for --overload-seconds: refusals (RESOURCE_EXHAUSTED) against
   answers, their latencies, and every answer checked. One client process sends all of it, so it
   shows the behaviour, not how fast a refusal is.
3. Refusal speed: open loop at --refusal-rate requests/s of [1, --refusal-length, d_model] from
   --refusal-processes client processes (mhaserve bench's load generator), against a queue of
   --burst-queue; the server with --inference-nice 10 (the default) and 0, in alternating rounds.
Client and server share this machine's cores; the client's own CPU time is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np

from mhaserve.loadtest.checked_load import Reference, Shapes, burst, make_call, mismatch, rss_mib, run_checked_load
from mhaserve.loadtest.loadgen import cpu_seconds
from mhaserve.server.process import ServerProcess


class Server(ServerProcess):
    """``mhaserve serve`` for one part of the run; its stop line (calls by status) is printed at the end."""

    def __init__(self, model_dir: Path, *args: str):
        super().__init__(model_dir, "--metrics-port", "-1", *args)

    def __exit__(self, *exc):
        self.stop()
        print(f"  server: {self.stop_line}")


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
    parser.add_argument("--refusal-rate", type=float, default=400.0, help="0 skips part 3")
    parser.add_argument("--refusal-length", type=int, default=128)
    parser.add_argument("--refusal-seconds", type=float, default=8.0)
    parser.add_argument("--refusal-rounds", type=int, default=2)
    parser.add_argument("--refusal-processes", type=int, default=2)
    args = parser.parse_args()

    from mhaserve.export.default_model import ensure_default_model

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
        cpu = cpu_seconds()
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
            print(f"  client CPU {cpu_seconds() - cpu:.0f} s over {report.elapsed_s:.0f} s")
            soak_ok = set(report.statuses) == {"OK"} and not report.mismatches

    print(f"\n2a. overload: a burst of {args.burst} requests at once, --max-queue-size {args.burst_queue}")
    rng = np.random.default_rng(1)
    with Server(model_dir, "--max-queue-size", str(args.burst_queue)) if args.burst else nullcontext() as server:
        calls = [make_call(rng, shapes) for _ in range(args.burst)] if server else []
        if server:
            report = asyncio.run(burst(server.url, calls, timeout_s=120))
            burst_ok = answered_or_refused(report, calls, reference)

    count = int(args.overload_rate * args.overload_seconds)
    print(f"\n2b. overload: open loop at {args.overload_rate:g}/s for {args.overload_seconds:g} s ({count} requests), "
          f"--max-queue-size {args.burst_queue}")  # fmt: skip
    with Server(model_dir, "--max-queue-size", str(args.burst_queue)) as server:
        calls = [make_call(rng, shapes) for _ in range(count)]
        cpu, started = cpu_seconds(), time.perf_counter()
        report = asyncio.run(burst(server.url, calls, timeout_s=120, rate=args.overload_rate))
        wall = time.perf_counter() - started
        open_ok = answered_or_refused(report, calls, reference)
        print(f"  client CPU {cpu_seconds() - cpu:.0f} s over {wall:.0f} s (the sender shares the cores)")

    refusal_ok = refusal_speed(model_dir, d_model, args) if args.refusal_rate else True

    print(f"\nsoak {'passed' if soak_ok else 'FAILED'}, burst {'passed' if burst_ok else 'FAILED'}, "
          f"open-loop overload {'passed' if open_ok else 'FAILED'}, "
          f"refusal speed {'passed' if refusal_ok else 'FAILED'}")  # fmt: skip
    return 0 if soak_ok and burst_ok and open_ok and refusal_ok else 1


def answered_or_refused(report, calls, reference: Reference) -> bool:
    """Print an overload part's outcome with every answer checked; True when each call was answered right or
    refused with RESOURCE_EXHAUSTED."""
    problems = [p for call in calls if call.status == "OK" and (p := mismatch(call, reference))]
    print("  " + report.summary().replace("\n", "\n  "))
    print(f"  every answer checked: {sum(c.status == 'OK' for c in calls)}, mismatches {len(problems)}")
    return set(report.statuses) <= {"OK", "RESOURCE_EXHAUSTED"} and not problems


def refusal_speed(model_dir: Path, d_model: int, args) -> bool:
    """Part 3: how fast the excess is refused, and what the accepted requests see, at each --inference-nice."""
    from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload

    length = args.refusal_length
    workload = Workload(d_model, 1, length, length)
    point = Point("open", args.refusal_rate, args.refusal_seconds, warmup_s=2.0)
    print(f"\n3. refusal speed: open loop at {args.refusal_rate:g}/s of [1,{length},{d_model}] with attn_weights, "
          f"{args.refusal_processes} client processes, --max-queue-size {args.burst_queue}")  # fmt: skip
    refused_p50: dict[int, list[float]] = {10: [], 0: []}
    statuses_ok = True
    for round_ in range(1, args.refusal_rounds + 1):
        for nice in refused_p50:
            extra = ("--max-queue-size", str(args.burst_queue), "--inference-nice", str(nice))
            with Server(model_dir, *extra) as server, LoadGenerator(server.url, args.refusal_processes) as load:
                r = load.measure(workload, point)
            refused = r.error_latency_ms.get("RESOURCE_EXHAUSTED", {"p50": float("nan"), "p99": float("nan")})
            refused_p50[nice].append(refused["p50"])
            others = {status: n for status, n in r.errors.items() if status != "RESOURCE_EXHAUSTED"}
            statuses_ok &= not others
            print(f"  round {round_}, --inference-nice {nice:2d}: OK {r.throughput:.0f}/s "
                  f"(p50 {r.latency_ms['p50']:.0f} ms, p99 {r.latency_ms['p99']:.0f} ms); "
                  f"refused {r.errors.get('RESOURCE_EXHAUSTED', 0)} in p50 {refused['p50']:.1f} ms, "
                  f"p99 {refused['p99']:.1f} ms; other errors {others or 0}; "
                  f"client {r.client_cpu_cores:.2f} cores")  # fmt: skip
    low, same = (float(np.median(refused_p50[n])) for n in (10, 0))
    print(f"  median refusal p50: {low:.1f} ms at nice 10, {same:.1f} ms at nice 0 (ratio {low / same:.2f})")
    return statuses_ok


if __name__ == "__main__":
    sys.exit(main())
