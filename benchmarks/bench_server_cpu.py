"""The server's CPU per request under load, against the bare Python gRPC server doing the same decode, run and
encode, side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_server_cpu.py [--rounds 3] [--duration 8]
        [--points 16x16,128x16]

Both serve the embedded default model (512/8) on the same two ORT threads; ``bare`` is bench_server.py's bare
server (parse, ``np.frombuffer``, ``session.run`` inline on the event loop, ``tobytes``; no validation, batching,
statistics or budget), ``server`` is ``mhaserve serve`` with its defaults. Each point is measured on one, then the
other, in alternating order from round to round, with ``mhaserve bench``'s load generator (gRPC, attention
weights asked for). Per point and server: requests/s, p50, the server process's CPU-seconds (user + system, from
/proc) per 1,000 requests over the measured window, and the cores its clients took. Then the medians and the
ratios server / bare. Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_server import start_helper_process  # this folder's: the bare server

from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.checked_load import process_cpu_seconds as cpu_seconds
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload, default_processes
from mhaserve.server.process import ServerProcess


def measured(url: str, pid: int, length: int, concurrency: int, args) -> dict:
    workload = Workload(512, 1, length, length, attn_weights=True)
    with LoadGenerator(url, args.processes) as generator:
        generator.measure(workload, Point("closed", concurrency, args.warmup, 0.0))  # warm-up, not counted
        before = cpu_seconds(pid)
        result = generator.measure(workload, Point("closed", concurrency, args.duration, 0.0))
        used = cpu_seconds(pid) - before
    assert not result.errors, result.errors
    return {
        "rps": result.throughput,
        "p50": result.latency_ms["p50"],
        "cpu_per_1000": 1000 * used / result.count,
        "client_cores": result.client_cpu_cores,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=2, help="ORT intra-op threads, both servers")
    parser.add_argument("--processes", type=int, default=default_processes())
    parser.add_argument("--points", default="16x16,128x16", help="LENGTHxCONCURRENCY,... at [1, LENGTH, 512]")
    args = parser.parse_args()
    points = [tuple(int(n) for n in p.split("x")) for p in args.points.split(",")]
    model_dir = ensure_default_model()
    bare, bare_url = start_helper_process("bare", model_dir, args.threads)
    figures: dict[tuple, dict[str, list[dict]]] = {}
    try:
        with ServerProcess(model_dir, "--intra-op-threads", str(args.threads)) as server:
            servers = [("bare", bare_url, bare.pid), ("server", server.url, server.pid)]
            header = f"{'req/s':>8} {'p50 ms':>7} {'CPU-s/1000':>10} {'client cores':>12}"
            print(f"{'point':>16} {'round':>5} {'':>7} | {header}")
            for round_number in range(args.rounds):
                order = servers if round_number % 2 == 0 else servers[::-1]
                for length, concurrency in points:
                    for name, url, pid in order:
                        f = measured(url, pid, length, concurrency, args)
                        figures.setdefault((length, concurrency), {}).setdefault(name, []).append(f)
                        label = f"[1,{length:>3},512] c{concurrency:<3}"
                        print(f"{label} {round_number + 1:>5} {name:>7} | {f['rps']:8.1f} {f['p50']:7.2f} "
                              f"{f['cpu_per_1000']:10.3f} {f['client_cores']:12.2f}", flush=True)  # fmt: skip
                    time.sleep(0.5)
    finally:
        bare.terminate()
        bare.wait()
    print("\nmedians, and server / bare:")
    for (length, concurrency), by_server in figures.items():
        median = {name: {k: statistics.median(f[k] for f in runs) for k in runs[0]} for name, runs in by_server.items()}
        s, b = median["server"], median["bare"]
        rps = f"req/s {s['rps']:.1f} / {b['rps']:.1f} = {s['rps'] / b['rps']:.2f}"
        cpu = f"{s['cpu_per_1000']:.3f} / {b['cpu_per_1000']:.3f} = {s['cpu_per_1000'] / b['cpu_per_1000']:.2f}"
        print(f"[1,{length:>3},512] c{concurrency:<3} {rps}; CPU-s per 1,000 requests {cpu}")


if __name__ == "__main__":
    main()
