"""Sequences against resending the prefix: a server of the embedded default model (512/8), one client process.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_sequences.py [--rounds 3] [--calls 30] [--latency-only]

Printed, each figure the median of ``--calls`` calls per round, rounds alternating the variants:
- a one-row step at position 500 against the 500-row prefix sent with a causal mask, output only (c=1), as unary
  calls and over one ModelStreamInfer stream, and the floor of each: a stateless one-row request; a one-row step of a
  cross-attention sequence given 500 keys against one row sent with those 500 keys each time;
- a one-row step at position 500 against one at position 10;
- steps a second with 1, 16 and 64 sequences stepping at once at about 32 and 256 rows (output only, gRPC aio),
  on the server as it runs (steps of several sequences sharing a call, short ones one padded run) and, side by
  side, on a second server whose ``--max-batch-size 1`` runs each step alone; rounds alternate the two; then the
  transport's ceiling, stateless one-row requests;
- first, the server's RSS per live sequence of 256 rows against its keys' and values' bytes.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_sequences.py --baseline REV [--rounds 3]
        [--positions 32,256,1024] [--prompts-apart] [--d-model 4096 --heads 32] [--cross]

instead serves another revision's code (and its own export of the same default model) beside the working tree's,
and prints each one's RSS per live sequence as above, then, per position (each sequence started again from that
prompt every 64 steps, the prompts' cost included; with ``--prompts-apart``, all started again together between
timed stretches of 64 steps each; ``--d-model``/``--heads``: a seeded model of that size, each revision exporting
its own; ``--cross``: cross-attention sequences, each given as many keys at its start, its steps query rows), the
steps a second of 1 and 64 sequences stepping at once on each and, at the end, each server's stateless one-row
requests a second from 64 callers, the rounds alternating the two servers.
    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_sequences.py --ceiling [--positions 32,256,1024]

instead prints, per position, what two cores allow 64 sequences' steps against the stateless one-row ceiling, if
a step cost the machine a stateless request's CPU and no more than its run's extra work: the server's and the
load generator's CPU per stateless one-row request from 64 callers (served), and, in process, the CPU per step of
64 sequences' one-row steps in one call of the step runs against per row of 64 one-row requests run as one batch;
then the served ratio measured (steps a second, prompts not timed, against the same server's stateless requests).
Not a test: BENCHMARKS.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from bench_revisions import baseline_checkout

from mhaserve.client.grpc import build_infer_request
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.checked_load import process_cpu_seconds, rss_mib
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.server.process import ServerProcess

D, H = 512, 8
UNLIMITED = [("grpc.max_receive_message_length", -1)]  # a prompt's answer at 4096 wide passes gRPC's 4 MiB
IDLE_S = 3.0  # the server gives its free memory back once idle 2 s


def request(rows: np.ndarray, sequence=None, start=False, end=False, mask=None, keys=None):
    message = build_infer_request("mha", rows, key=keys, value=keys, mask=mask, attn_weights=False)
    if sequence is not None:
        message.parameters["sequence_id"].string_param = sequence
        message.parameters["sequence_start"].bool_param = start
        message.parameters["sequence_end"].bool_param = end
    return message


async def grow(stub, name: str, length: int, rng, cross: bool = False) -> None:
    """Start sequence ``name`` at ``length`` rows: a prompt, or (``cross``) one query row given ``length`` keys."""
    x = rng.standard_normal((1, length, D), dtype=np.float32)
    message = request(x[:, :1], name, start=True, keys=x) if cross else request(x, name, start=True)
    await stub.ModelInfer(message, timeout=60)


async def streamed_ms(stub, make, calls: int) -> float:
    """As timed_ms, the calls sent one after another over one ModelStreamInfer stream, each timed from its write
    to its answer."""
    stream, times = stub.ModelStreamInfer(), []
    for _ in range(calls):
        message = make()
        started = time.perf_counter()
        await stream.write(message)
        answer = await stream.read()
        times.append((time.perf_counter() - started) * 1000)
        if answer.error_message:
            raise RuntimeError(answer.error_message)
    await stream.done_writing()
    return statistics.median(times)


async def rss_per_sequence(stub, server: ServerProcess, rng, name: str = "") -> None:
    """The server's RSS grown by 64 live sequences of 256 rows, against their keys' and values' bytes."""
    before = rss_mib(server.proc.pid)
    for i in range(64):
        await grow(stub, f"memory-{i}", 256, rng)
    await asyncio.sleep(IDLE_S)
    grown = rss_mib(server.proc.pid) - before
    cache_mib = 64 * 2 * 256 * D * 4 / 2**20
    print(f"{name}64 live sequences of 256 rows: RSS +{grown:.1f} MiB for {cache_mib:.1f} MiB of keys and values "
          f"({grown / cache_mib:.2f}x)")  # fmt: skip
    row = np.zeros((1, 1, D), np.float32)
    for i in range(64):  # one step more: where buffers make room, each has just made it
        await stub.ModelInfer(request(row, f"memory-{i}"), timeout=60)
    await asyncio.sleep(IDLE_S)
    grown, cache_mib = rss_mib(server.proc.pid) - before, cache_mib * 257 / 256
    print(f"{name}the same after one step each (257 rows): RSS +{grown:.1f} MiB for {cache_mib:.1f} MiB "
          f"({grown / cache_mib:.2f}x)")  # fmt: skip
    for i in range(64):
        await stub.ModelInfer(request(row, f"memory-{i}", end=True), timeout=60)


async def timed_ms(stub, make, calls: int) -> float:
    times = []
    for _ in range(calls):
        message = make()
        started = time.perf_counter()
        await stub.ModelInfer(message, timeout=60)
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


async def main(rounds: int, calls: int, server: ServerProcess) -> None:
    rng = np.random.default_rng(0)
    row = rng.standard_normal((1, 1, D), dtype=np.float32)
    prefix = rng.standard_normal((1, 500, D), dtype=np.float32)
    causal = np.tril(np.ones((1, 500, 500), bool))
    async with grpc.aio.insecure_channel(server.url, options=UNLIMITED) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        # First, on a server that has not yet run steps: what a live sequence holds.
        await rss_per_sequence(stub, server, rng)

        figures = {"step at 500": [], "prefix of 500": [], "step at 10": [], "stream step at 500": [],
                   "stream prefix of 500": [], "one row": [], "stream one row": [], "cross step over 500 keys": [],
                   "one row over 500 keys": []}  # fmt: skip
        for number in range(rounds):
            # Each call steps a fresh sequence grown to the position, then ended: the position stays put.
            for name in figures:
                streamed = name.startswith("stream ")
                timed = streamed_ms if streamed else timed_ms
                if name.endswith("prefix of 500"):
                    figures[name].append(await timed(stub, lambda: request(prefix, mask=causal), calls))
                    continue
                if name.endswith("one row"):  # the floor: a stateless request of one row
                    figures[name].append(await timed(stub, lambda: request(row), calls))
                    continue
                if name == "one row over 500 keys":  # cross-attention, the keys and values sent with each request
                    figures[name].append(await timed(stub, lambda: request(row, keys=prefix), calls))
                    continue
                if name == "cross step over 500 keys":  # the keys and values given once, with the first step
                    sequence = f"round{number}-{name}"
                    await stub.ModelInfer(request(row, sequence, start=True, keys=prefix), timeout=60)
                    figures[name].append(await timed(stub, lambda s=sequence: request(row, s), calls))
                    await stub.ModelInfer(request(row, sequence, end=True), timeout=60)
                    continue
                position = 500 if name.endswith("step at 500") else 10
                sequence = f"round{number}-{name}"
                await grow(stub, sequence, position, rng)
                figures[name].append(await timed(stub, lambda s=sequence: request(row, s, start=False), calls))
                await stub.ModelInfer(request(row, sequence, end=True), timeout=60)
        med = {name: statistics.median(values) for name, values in figures.items()}
        print(f"c=1, output only, median of {rounds} rounds x {calls} calls (the step grows its sequence each call):")
        for name, value in med.items():
            print(f"  {name:>14}: {value:8.3f} ms  (rounds: {', '.join(f'{v:.3f}' for v in figures[name])})")
        print(f"  step at 500 / prefix of 500: {med['step at 500'] / med['prefix of 500']:.3f}")
        print(f"  over a stream, step at 500 / prefix of 500: "
              f"{med['stream step at 500'] / med['stream prefix of 500']:.3f}")  # fmt: skip
        print(f"  cross step over 500 keys / one row sending them: "
              f"{med['cross step over 500 keys'] / med['one row over 500 keys']:.3f}")  # fmt: skip
        print(f"  step at 500 / step at 10:    {med['step at 500'] / med['step at 10']:.3f}")


async def steps_per_second(
    url: str,
    concurrency: int,
    rng,
    seconds: float = 5.0,
    position: int = 256,
    window: int | None = None,
    prompts_timed: bool = True,
    cross: bool = False,
) -> float:
    """Steps a second with ``concurrency`` sequences of about ``position`` rows stepping at once, one row a step;
    with ``window``, each sequence is started again from a ``position``-row prompt every ``window`` steps, so that
    the position stays within the window: the prompts' cost included, or (``prompts_timed`` False) all sequences
    started again together between timed stretches of ``window`` steps each. ``cross``: cross-attention sequences
    given ``position`` keys at their start, each step a query row over them."""
    async with grpc.aio.insecure_channel(url, options=UNLIMITED) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        row = rng.standard_normal((1, 1, D), dtype=np.float32)
        names = [f"conc{concurrency}-{i}-{rng.integers(1 << 30)}" for i in range(concurrency)]
        for name in names:
            await grow(stub, name, position, rng, cross)
        done, restarting = 0, asyncio.Lock()

        async def stepper(name: str, stop: float, steps: int | None = None) -> None:
            nonlocal done
            message = request(row, name)  # built once, as the stateless ceiling's is: the client's cost is not measured
            taken = 0
            while time.perf_counter() < stop and taken != steps:
                if window is not None and taken == window:
                    async with restarting:  # one prompt at a time: 64 long prompts at once pass the memory budget
                        await grow(stub, name, position, rng, cross)
                    taken = 0
                await stub.ModelInfer(message, timeout=60)
                done += 1
                taken += 1

        if prompts_timed or window is None:
            started = time.perf_counter()
            await asyncio.gather(*(stepper(name, started + seconds) for name in names))
            timed = time.perf_counter() - started
        else:
            timed = 0.0
            while timed < seconds:
                started = time.perf_counter()
                await asyncio.gather(*(stepper(name, started + seconds - timed, window) for name in names))
                timed += time.perf_counter() - started
                for name in names:  # untimed: back to the position
                    await grow(stub, name, position, rng, cross)
        rate = done / timed
        for name in names:
            await stub.ModelInfer(request(row, name, end=True), timeout=60)
    return rate


async def stateless_per_second(url: str, concurrency: int, seconds: float = 5.0) -> float:
    """The transport's ceiling for steps: stateless one-row requests (no sequence), output only, as many at once."""
    async with grpc.aio.insecure_channel(url, options=UNLIMITED) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        message = request(np.ones((1, 1, D), np.float32))
        done = 0

        async def sender(stop: float) -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await stub.ModelInfer(message, timeout=60)
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(sender(started + seconds) for _ in range(concurrency)))
        return done / (time.perf_counter() - started)


async def merged_against_alone(merged: ServerProcess, alone: ServerProcess, rounds: int, position: int) -> None:
    rng = np.random.default_rng(1)
    print(f"steps/s at ~{position} rows, median of {rounds} rounds (merged: steps share calls; alone: "
          "--max-batch-size 1):")  # fmt: skip
    medians = {}
    for concurrency in (1, 16, 64):
        rates = {"merged": [], "alone": []}
        for _ in range(rounds):
            for name, server in (("merged", merged), ("alone", alone)):
                rates[name].append(await steps_per_second(server.url, concurrency, rng, position=position))
        medians[concurrency] = {name: statistics.median(values) for name, values in rates.items()}
        m, a = medians[concurrency]["merged"], medians[concurrency]["alone"]
        print(f"{concurrency:3d} sequences: merged {m:8.1f}  alone {a:8.1f}  merged / alone {m / a:5.2f}  "
              f"(rounds merged {', '.join(f'{r:.0f}' for r in rates['merged'])}; "
              f"alone {', '.join(f'{r:.0f}' for r in rates['alone'])})")  # fmt: skip
    for name in ("merged", "alone"):
        print(f"{name}: 64 sequences / 1 sequence: {medians[64][name] / medians[1][name]:.2f}")
    if position != 256:
        return
    ceiling = statistics.median([await stateless_per_second(merged.url, 64) for _ in range(rounds)])
    print(f"ceiling: stateless one-row requests, output only, 64 at once: {ceiling:.1f}/s "
          f"(merged 64 sequences: {medians[64]['merged'] / ceiling:.2f} of it)")  # fmt: skip


async def against_baseline(
    baseline: ServerProcess,
    current: ServerProcess,
    rounds: int,
    positions: tuple[int, ...],
    prompts_timed: bool,
    cross: bool = False,
) -> None:
    rng = np.random.default_rng(2)
    servers = {"baseline": baseline, "current": current}
    for name, server in servers.items():  # first, on servers that have not yet run steps
        async with grpc.aio.insecure_channel(server.url, options=UNLIMITED) as channel:
            await rss_per_sequence(pb_grpc.GRPCInferenceServiceStub(channel), server, rng, f"{name}: ")
    prompts = "the prompts timed" if prompts_timed else "the prompts not timed"
    print(f"steps/s, one row a step, each sequence started again from its prompt every 64 steps ({prompts}), median "
          "of rounds (the rounds alternate the servers):")  # fmt: skip
    for position in positions:
        for concurrency in (1, 64):
            rates = {name: [] for name in servers}
            for round_ in range(rounds):
                for name in list(servers)[:: 1 if round_ % 2 == 0 else -1]:
                    rate = await steps_per_second(
                        servers[name].url,
                        concurrency,
                        rng,
                        position=position,
                        window=64,
                        prompts_timed=prompts_timed,
                        cross=cross,
                    )
                    rates[name].append(rate)
            b, c = (statistics.median(rates[name]) for name in servers)
            spread = "; ".join(f"{name} {', '.join(f'{r:.0f}' for r in rates[name])}" for name in servers)
            print(f"  ~{position:4d} rows, {concurrency:2d} sequences: baseline {b:8.1f}  current {c:8.1f}  "
                  f"current / baseline {c / b:5.2f}  (rounds: {spread})")  # fmt: skip
    for name, server in servers.items():
        ceiling = statistics.median([await stateless_per_second(server.url, 64) for _ in range(rounds)])
        print(f"  {name}: stateless one-row requests, 64 at once: {ceiling:.1f}/s")


def in_process_cpu_ms(positions: tuple[int, ...], calls: int = 30) -> tuple[float, dict[int, float]]:
    """This process's CPU ms (every thread) per row of 64 one-row requests run as one batch, and per step of 64
    sequences' one-row steps in one call of the step runs at each position (output only, as served below)."""
    from mhaserve.server.graphs import AttentionGraphs
    from mhaserve.server.sequences import Step
    from mhaserve.server.sequences.runtime import open_step_graphs

    session, rng = AttentionGraphs.open(ensure_default_model(), "cpu"), np.random.default_rng(3)
    step_graph = open_step_graphs(session)[0]

    def cpu_ms_each(call, count: int) -> float:
        for _ in range(5):
            call()
        started = time.process_time()
        for _ in range(calls):
            call()
        return (time.process_time() - started) / calls / count * 1e3

    rows, mask = rng.standard_normal((64, 1, D), dtype=np.float32), np.ones((64, 1, 1, 1), bool)
    per_row = cpu_ms_each(lambda: session.run(["output"], rows, rows, rows, mask), 64)
    per_step = {}
    for position in positions:
        steps = []
        for i in range(64):
            prompt = rng.standard_normal((1, position + i % 8, D), dtype=np.float32)
            cache = step_graph.run_step(Step(prompt[:, :-1], step_graph.empty_cache(1)))[2]
            cache = step_graph.run_step(Step(prompt[:, -1:], cache))[2]  # buffers with room, as served
            steps.append(Step(rng.standard_normal((1, 1, D), dtype=np.float32), cache, weights=False))
        per_step[position] = cpu_ms_each(lambda steps=steps: step_graph.run_steps(steps), 64)
    return per_row, per_step


async def ceiling(server: ServerProcess, positions: tuple[int, ...], rounds: int) -> None:
    per_row, per_step = in_process_cpu_ms(positions)
    served = []
    for _ in range(rounds):
        server_s, client_s = process_cpu_seconds(server.proc.pid), time.process_time()
        rate = await stateless_per_second(server.url, 64)
        requests = rate * 5.0
        server_used = process_cpu_seconds(server.proc.pid) - server_s
        served.append((server_used / requests, (time.process_time() - client_s) / requests))
    per_request = statistics.median(s + c for s, c in served) * 1e3
    print(f"CPU ms per stateless one-row request from 64 callers: server and load generator {per_request:.3f} (rounds "
          f"{', '.join(f'{(s + c) * 1e3:.3f}' for s, c in served)}); in process: per row of a batch of 64 "
          f"{per_row:.3f}")  # fmt: skip
    rng = np.random.default_rng(4)
    for position in positions:
        extra = per_step[position] - per_row
        bound = per_request / (per_request + max(extra, 0.0))
        ratios = []
        for _ in range(rounds):
            steps = await steps_per_second(server.url, 64, rng, position=position, window=64, prompts_timed=False)
            ratios.append(steps / await stateless_per_second(server.url, 64))
        print(f"  ~{position:4d} rows: in process {per_step[position]:.3f} ms a step, {extra:+.3f} against a row; "
              f"two cores allow {bound:.2f} of the stateless ceiling; served {statistics.median(ratios):.2f} "
              f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})")  # fmt: skip


def export_at(env: dict[str, str], out: Path) -> Path:
    """The seeded model of width D exported by a revision's own code (its step graphs are that revision's)."""
    subprocess.run([sys.executable, "-m", "mhaserve.cli", "export", "--out", str(out), "--d-model", str(D), "--heads",
                    str(H)], env=env, check=True, capture_output=True)  # fmt: skip
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--latency-only", action="store_true", help="only the one-client figures (c=1)")
    parser.add_argument("--baseline", help="serve this revision beside the working tree, steps/s at 32-1,024 rows")
    parser.add_argument("--ceiling", action="store_true", help="what two cores allow steps against stateless rows")
    parser.add_argument(
        "--positions",
        default="32,256,1024",
        help="with --baseline or --ceiling: the positions, comma-separated (none: memory and ceilings only)",
    )
    parser.add_argument("--d-model", type=int, default=D, help="with --baseline: the seeded model's width")
    parser.add_argument("--cross", action="store_true", help="with --baseline: cross-attention sequences, the position "
                        "their keys given at the start")  # fmt: skip
    parser.add_argument("--heads", type=int, default=H, help="with --baseline: its heads")
    parser.add_argument(
        "--prompts-apart",
        action="store_true",
        help="with --baseline: the sequences started again together between timed stretches of steps",
    )
    args = parser.parse_args()
    flags = ("--warmup-runs", "1", "--max-sequence-length", "4096", "--max-kv-len", "512", "--max-q-len", "512")
    if args.baseline or args.ceiling:  # steps at 1,024 rows: their prompts
        flags = ("--warmup-runs", "1", "--max-sequence-length", "4096", "--max-kv-len", "1024", "--max-q-len", "1024",
                 "--max-inflight-bytes", str(4 << 30))  # fmt: skip
    if args.baseline:
        with baseline_checkout(args.baseline) as (env, _), tempfile.TemporaryDirectory() as tmp:
            D, H = args.d_model, args.heads
            folder = export_at({**os.environ, **env}, Path(tmp) / "baseline-model")
            default = (D, H) == (512, 8)
            current_folder = ensure_default_model() if default else export_at(dict(os.environ), Path(tmp) / "current")
            with (
                ServerProcess(folder, *flags, env=env) as baseline,
                ServerProcess(current_folder, *flags) as current,
            ):
                positions = tuple(int(p) for p in args.positions.split(",") if p)
                timed = not args.prompts_apart
                asyncio.run(against_baseline(baseline, current, args.rounds, positions, timed, args.cross))
        raise SystemExit(0)
    if args.ceiling:
        with ServerProcess(ensure_default_model(), *flags) as served:
            asyncio.run(ceiling(served, tuple(int(p) for p in args.positions.split(",")), args.rounds))
        raise SystemExit(0)
    with ServerProcess(ensure_default_model(), *flags) as served:
        asyncio.run(main(args.rounds, args.calls, served))
    if args.latency_only:
        raise SystemExit(0)
    # Two fresh servers, alike but for --max-batch-size, so that neither carries the runs above.
    with (
        ServerProcess(ensure_default_model(), *flags) as merged,
        ServerProcess(ensure_default_model(), *flags, "--max-batch-size", "1") as alone,
    ):
        for position in (32, 256):
            asyncio.run(merged_against_alone(merged, alone, args.rounds, position))
