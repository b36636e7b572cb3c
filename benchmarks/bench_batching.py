"""Length-aware batching against one padded run per take: the same server, A/B through its flag, one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_batching.py [--duration 10] [--warmup 2]

Two servers on the embedded default model (512/8), identical but for --length-aware-batching, both up
for the whole run; each point is measured on one, then the other (only the measured one gets load),
with `mhaserve bench`'s load generator. Per point and server: throughput, p50 and p99, errors, the
clients' CPU, and the mean padding share of the runs in that point (from the server's
mhaserve_inference_padding_ratio histogram). Not a test: it prints numbers; BENCHMARKS.md records them.

Each mixed range also gets its no-padding bound, measured on the first server in the same round: what
the range would reach if every request cost what it costs in equal-length traffic of its own length
(see no_padding_bound). Equal-length traffic is the best any batching policy can meet, so the bound says
how much of a policy's shortfall is left to take. Beside it, the best any split can do at the length-aware
server's fitted prices (see best_split_share): the bound pays one run per full batch, a split of mixed lengths
pays a run per group or pads, and that price is what keeps splitting below the bound.
``--policy NAME="SERVER ARGS"`` (repeated) measures other servers instead, for example a thread layout:
``--policy padded="--length-aware-batching false" --policy aware-2x1="--inference-workers 2 --intra-op-threads 1"``,
or worker processes (with ``--connections 16``: the kernel spreads connections, not calls, over the workers):
``--policy one="--workers 1" --policy two="--workers 2"``.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import urllib.request

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload, default_processes
from mhaserve.server.config import ServerSettings
from mhaserve.server.process import ServerProcess
from mhaserve.server.run_cost import RunCost, plan_runs

# (min length, max length, concurrency): the mixed ranges, then equal lengths, where the planner must not
# change anything.
POINTS = [
    (16, 128, 16),
    (16, 128, 64),
    (16, 512, 16),
    (16, 512, 64),
    (16, 16, 16),
    (128, 128, 16),
]
BOUND_BINS = 5
POLICIES = {"padded": "--length-aware-batching false", "length-aware": "--length-aware-batching true"}


def padding_totals(server: ServerProcess) -> tuple[float, float]:
    """(sum, count) of the padding-ratio histogram: the mean over a stretch is the ratio of their deltas."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        families = text_string_to_metric_families(response.read().decode())
    values = {s.name: s.value for f in families if f.name == "mhaserve_inference_padding_ratio" for s in f.samples}
    return values.get("mhaserve_inference_padding_ratio_sum", 0.0), values.get(
        "mhaserve_inference_padding_ratio_count", 0.0
    )


def bound_lengths(low: int, high: int, bins: int = BOUND_BINS) -> list[int]:
    """The middles of ``bins`` equal-width bins of the lengths low..high (inclusive, drawn uniformly)."""
    width = (high - low + 1) / bins
    return [round(low - 0.5 + width * (i + 0.5)) for i in range(bins)]


def measure(name: str, server: ServerProcess, workload: Workload, point: Point, processes: int):
    """One point on one server, printed as a line: (result, mean padding share of its runs)."""
    before = padding_totals(server)
    with LoadGenerator(server.url, processes) as generator:
        result = generator.measure(workload, point)
    after = padding_totals(server)
    runs = after[1] - before[1]
    padding = (after[0] - before[0]) / runs if runs else 0.0
    lengths = (
        str(workload.min_len) if workload.min_len == workload.max_len else f"{workload.min_len}..{workload.max_len}"
    )
    print(
        f"{lengths:>9} {int(point.load):>3} {name:>14} | {result.throughput:7.1f} {result.latency_ms['p50']:7.2f} "
        f"{result.latency_ms['p99']:7.2f} {sum(result.errors.values()):>6} {result.client_cpu_cores:12.2f} "
        f"{padding:7.2f} |",
        flush=True,
    )
    return result, padding


def no_padding_bound(
    server: ServerProcess, low: int, high: int, point: Point, processes: int, connections: int = 0
) -> float | None:
    """Requests/s that lengths drawn from low..high would reach if every request cost what it costs in
    equal-length traffic of its own length (runs as full, nothing padded): one over the mean of those
    per-request times, at the middles of BOUND_BINS bins. No batching policy can do better than
    equal-length traffic, which needs neither padding nor extra runs."""
    seconds_per_request = []
    for length in bound_lengths(low, high):
        result, _ = measure(
            "equal",
            server,
            Workload(512, 1, length, length, attn_weights=True, connections=connections),
            point,
            processes,
        )
        if sum(result.errors.values()) or not result.throughput:
            return None  # refused requests (the in-flight budget, say) make it no bound of served traffic
        seconds_per_request.append(1 / result.throughput)
    return 1 / statistics.mean(seconds_per_request)


def logged_run_cost(server: ServerProcess) -> str | None:
    """The run cost model as the server logged it at start-up (None: length-aware batching off)."""
    return next((line.split("run cost model ")[1].strip() for line in server.lines if "run cost model" in line), None)


def fitted_run_cost(server: ServerProcess) -> RunCost | None:
    """The run cost model the server fitted at warm-up, read back from its start-up log."""
    found = re.search(
        r": ([\d.]+) us \+ ([\d.]+) ns per token \+ ([\d.]+) ns per query-key", logged_run_cost(server) or ""
    )
    if found is None:
        return None
    overhead_us, per_token_ns, per_pair_ns = map(float, found.groups())
    return RunCost(overhead_us * 1e-6, per_token_ns * 1e-9, per_pair_ns * 1e-9)


def best_split_share(cost: RunCost, low: int, high: int, requests: int, draws: int = 300, seed: int = 0) -> float:
    """Modelled: the no-padding cost of a take of ``requests`` self-attention requests of lengths drawn from
    low..high (one run per full batch, as equal-length traffic pays) over the cost of the best split of it
    (plan_runs), both at ``cost``'s prices; the mean over ``draws`` takes. A take holds at most as many
    requests as there are callers, and a larger take splits closer to the bound, so with ``requests`` the
    concurrency this is the most that splitting mixed lengths can reach of the bound (in model compute;
    the event loop's share of each request, the same for both, brings measured ratios nearer one)."""
    max_rows = ServerSettings().max_batch_size
    rng = np.random.default_rng(seed)
    shares = []
    for _ in range(draws):
        shapes = [(1, int(n), int(n)) for n in rng.integers(low, high + 1, requests)]
        split = sum(cost.padded_run_seconds([shapes[i] for i in run]) for run in plan_runs(shapes, cost, max_rows))
        unpadded = sum(cost.seconds(*shape) - cost.overhead_s for shape in shapes)
        unpadded += cost.overhead_s * -(-requests // max_rows)
        shares.append(unpadded / split)
    return float(np.mean(shares))


def summary(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=1, help="rounds per point, alternating the servers' order")
    parser.add_argument("--max-len", type=int, default=512, help="only the points whose lengths reach no further")
    parser.add_argument("--lengths", action="append", metavar="LOW..HIGH", help="only these points (repeatable)")
    parser.add_argument(
        "--policy",
        action="append",
        metavar="NAME=SERVER ARGS",
        help="a server to measure instead of the two defaults (repeatable; ratios are to the first)",
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=0,
        help="gRPC connections in all (0: one per client process); a server of workers spreads connections over them",
    )
    parser.add_argument(
        "--bound",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure each mixed range's no-padding bound (equal lengths across the range) on the first server",
    )
    args = parser.parse_args()
    policies = dict(p.split("=", 1) for p in args.policy) if args.policy else POLICIES
    model_dir = ensure_default_model()
    servers = {name: ServerProcess(model_dir, *flags.split()).start() for name, flags in policies.items()}
    first = next(iter(servers))
    for name, server in servers.items():
        logged = logged_run_cost(server)
        print(f"{name}: {server.url}" + (f"; run cost model {logged}" if logged else ""))
    # The first length-aware server's prices, for the modelled best split (best_split_share).
    fitted = next((cost for cost in map(fitted_run_cost, servers.values()) if cost is not None), None)
    processes = default_processes()
    print(f"client processes: {processes}; {args.warmup:g} s warm-up + {args.duration:g} s per point\n")
    print(f"{'lengths':>9} {'c':>3} {'server':>14} | {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} "
          f"{'client cores':>12} {'padding':>7} |")  # fmt: skip
    try:
        chosen = [p for p in POINTS if p[1] <= args.max_len and (not args.lengths or f"{p[0]}..{p[1]}" in args.lengths)]
        for low, high, concurrency in chosen:
            point = Point("closed", concurrency, args.duration, args.warmup)
            mixed = Workload(512, 1, low, high, attn_weights=True, connections=args.connections)
            ratios: dict[str, list[float]] = {name: [] for name in servers if name != first}
            bounds: list[float] = []  # the no-padding bound over the first server's throughput, per round
            for round_ in range(1, args.rounds + 1):
                print(f"round {round_}")
                # Alternating order: whichever server goes first in a round does not always go first.
                order = list(servers.items()) if round_ % 2 else list(reversed(servers.items()))
                results = {name: measure(name, server, mixed, point, processes)[0] for name, server in order}
                for name in ratios:
                    ratios[name].append(results[name].throughput / results[first].throughput)
                if args.bound and low != high:
                    bound = no_padding_bound(servers[first], low, high, point, processes, args.connections)
                    if bound is None:
                        print(f"{low}..{high} {concurrency:>3} no-padding bound: not measured (errors)", flush=True)
                        continue
                    bounds.append(bound / results[first].throughput)
                    print(f"{low}..{high} {concurrency:>3} no-padding bound: {bound:.1f} req/s", flush=True)
            label = f"{low}..{high}" if low != high else str(low)
            for name, values in ratios.items():
                print(f"{label:>9} {concurrency:>3} {name} / {first}: {summary(values)}", flush=True)
            if bounds:
                print(f"{label:>9} {concurrency:>3} no-padding bound / {first}: {summary(bounds)}", flush=True)
                for name, values in ratios.items():
                    if len(values) != len(bounds):
                        continue  # a round without its bound
                    of_bound = [ratio / bound for ratio, bound in zip(values, bounds, strict=True)]
                    print(f"{label:>9} {concurrency:>3} {name} / bound: {summary(of_bound)}", flush=True)
            if fitted is not None and low != high:
                share = best_split_share(fitted, low, high, concurrency)
                print(f"{label:>9} {concurrency:>3} best split / bound, modelled at the fitted prices: {share:.2f}")
            print()
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
