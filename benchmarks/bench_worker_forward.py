"""Sequences across worker processes: what forwarding a step to the worker that holds its sequence costs, and steps
a second with 1, 2 and 3 workers. A server of the embedded default model (512/8), output only, one-row steps.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_worker_forward.py [--rounds 3] [--steps 200]
        [--workers 2,3] [--duration 6] [--device cuda]

Printed:
- the hop's floor: a one-row step's payload sent to another process and back over a Unix socket, by the forward's
  own framing on asyncio event loops at both ends, and by blocking sockets (the kernel's round trip): medians over
  ``--hops`` round trips, what a forward costs before either worker does anything with the step;
- latency: on a server of 2 workers, one gRPC connection (so one worker), sequences started over it (living in
  its worker) against sequences started over a connection that reached the other worker, their steps alternating
  one by one on the first connection: the p50 and p90 of each, over ``--steps`` steps per round, and the
  difference at p50;
- correctness at scale (``--sequences``): with 2 and 3 workers, that many sequences of 4 one-row steps, every
  step on a new connection, half over gRPC and half over HTTP/REST (urllib: no keep-alive): steps refused, and the
  largest difference of a row from the same sequence's rows on a server of one process;
- throughput: 64 sequences stepping at once from 16 connections (the load generator, closed loop) on 1 worker and
  on each of ``--workers``; steps a second and the ratio to 1 worker, rounds alternating the servers.

Not a test: BENCHMARKS.md records the figures with this command.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import pickle
import socket
import statistics
import sys
import tempfile
import time

import grpc
import numpy as np
from bench_revisions import ROOT

from mhaserve.client.grpc import build_infer_request
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.server.process import ServerProcess
from mhaserve.server.worker_forward import FramedConnection

sys.path.insert(0, str(ROOT))
from tests.support import by_worker, worker_that_took  # noqa: E402

D = 512


def step(name: str, start: bool, rng) -> object:
    message = build_infer_request("mha", rng.standard_normal((1, 1, D), dtype=np.float32), attn_weights=False)
    message.parameters["sequence_id"].string_param = name
    message.parameters["sequence_start"].bool_param = start
    return message


def forwarded_by_worker(server: ServerProcess) -> dict[str, float]:
    return by_worker(server, "mhaserve_sequence_steps_forwarded_total")


def start_on(server: ServerProcess, stub, names: list[str], rng) -> int:
    """Start the sequences ``names`` over ``stub``'s connection: the worker they live in (the connection's)."""

    def start() -> None:
        for name in names:
            stub.ModelInfer(step(name, True, rng), timeout=30)

    return worker_that_took(server, start)


def latency_ms(server: ServerProcess, steps: int, rng, tag: str) -> tuple[list[float], list[float]]:
    """Step latencies on one connection: of sequences living in the worker it reached (started over it), and of
    sequences started over a connection that reached the other worker (forwarded), alternating step by step."""
    channel = grpc.insecure_channel(server.url, options=[("grpc.use_local_subchannel_pool", 1)])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    names = {where: [f"{where}-{tag}-{i}" for i in range(8)] for where in ("here", "away")}
    here = start_on(server, stub, names["here"], rng)
    for attempt in range(64):  # new connections until one reaches the other worker
        with grpc.insecure_channel(server.url, options=[("grpc.use_local_subchannel_pool", 1)]) as other:
            probe = [f"probe-{tag}-{attempt}"]
            if start_on(server, pb_grpc.GRPCInferenceServiceStub(other), probe, rng) != here:
                start_on(server, pb_grpc.GRPCInferenceServiceStub(other), names["away"], rng)
                break
    else:
        raise SystemExit("64 new connections reached the same worker")
    timed: dict[str, list[float]] = {"here": [], "away": []}
    for i in range(steps):
        for where in ("here", "away"):
            message = step(names[where][i % 8], False, rng)
            started = time.perf_counter()
            stub.ModelInfer(message, timeout=30)
            timed[where].append((time.perf_counter() - started) * 1e3)
    channel.close()
    return timed["here"], timed["away"]


def stepped_on_new_connections(server: ServerProcess, sequences: int, rng_seed: int) -> tuple[int, dict]:
    """Each sequence's 4 one-row steps, each on a new connection (gRPC for even sequences, HTTP/REST for odd):
    the steps refused, and every sequence's rows answered."""
    from mhaserve.client import Client, HttpClient, RequestFailed
    from mhaserve.client.common import SequenceStep

    rng, refused, answered = np.random.default_rng(rng_seed), 0, {}
    http = server.http_url.removeprefix("http://")
    for number in range(sequences):
        rows, name, got = rng.standard_normal((1, 4, D), dtype=np.float32), f"scale-{rng_seed}-{number}", []
        for position in range(4):
            step = SequenceStep(name, start=position == 0, end=position == 3, position=position)
            try:
                if number % 2:
                    got.append(HttpClient(http).infer(rows[:, position : position + 1], attn_weights=False,
                                                      sequence=step).output)  # fmt: skip
                else:
                    with Client(server.url, own_connection=True) as client:
                        got.append(client.infer(rows[:, position : position + 1], attn_weights=False,
                                                sequence=step).output)  # fmt: skip
            except RequestFailed:
                refused += 1
                break
        answered[number] = np.concatenate(got, axis=1) if len(got) == 4 else None
    return refused, answered


def quantiles(values: list[float]) -> tuple[float, float]:
    cut = statistics.quantiles(values, n=10)
    return statistics.median(values), cut[8]


def _echo(path: str) -> None:
    """In another process: the forward's framing on an event loop, answering each message with its payload."""

    async def serve() -> None:
        def on_message(connection, number: int, sent: dict) -> None:
            connection.send(number, {"error": None, "outputs": sent["outputs"]})

        await asyncio.get_running_loop().create_unix_server(lambda: FramedConnection(on_message), path)
        await asyncio.sleep(3600)

    asyncio.run(serve())


def _echo_blocking(connection: socket.socket, size: int) -> None:
    while data := connection.recv(1 << 16):
        while len(data) < size:
            data += connection.recv(1 << 16)
        connection.sendall(data)


def hop_floor_us(hops: int) -> tuple[float, float]:
    """Median round trips (us) of a one-row step's payload to another process and back: the forward's framing on
    asyncio at both ends, and blocking sockets."""
    payload = {"outputs": {"output": np.zeros((1, 1, D), np.float32)}}
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/echo.sock"
        echo = multiprocessing.get_context("spawn").Process(target=_echo, args=(path,), daemon=True)
        echo.start()
        while not os.path.exists(path):
            time.sleep(0.01)

        async def exchanges() -> list[float]:
            _, peer = await asyncio.get_running_loop().create_unix_connection(FramedConnection, path)
            times = []
            for _ in range(hops):
                started = time.perf_counter()
                await peer.exchange(payload)
                times.append(time.perf_counter() - started)
            peer.close()
            return times

        framed = asyncio.run(exchanges())
        echo.terminate()
    ours, theirs = socket.socketpair()
    data = bytes(len(pickle.dumps(payload, protocol=5)))
    echo = multiprocessing.get_context("fork").Process(target=_echo_blocking, args=(theirs, len(data)), daemon=True)
    echo.start()
    blocking = []
    for _ in range(hops):
        started = time.perf_counter()
        ours.sendall(data)
        received = 0
        while received < len(data):
            received += len(ours.recv(1 << 16))
        blocking.append(time.perf_counter() - started)
    echo.terminate()
    ours.close()
    skip = hops // 10  # the first round trips warm both ends up
    return statistics.median(framed[skip:]) * 1e6, statistics.median(blocking[skip:]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--workers", default="2,3")
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--sequences", type=int, default=64, help="sequences stepped on new connections (0: none)")
    parser.add_argument("--hops", type=int, default=2000, help="round trips timed for the hop's floor (0: none)")
    parser.add_argument("--device", default="cpu", help="the servers' --device (cuda on a GPU host)")
    args = parser.parse_args()
    model = ensure_default_model()
    device = ("--device", args.device)
    rng = np.random.default_rng(1)
    if args.hops:
        for number in range(1, args.rounds + 1):
            framed, blocking = hop_floor_us(args.hops)
            print(f"the hop's floor, round {number}: the forward's framing on asyncio {framed:.0f} us, blocking "
                  f"sockets {blocking:.0f} us (median round trip)", flush=True)  # fmt: skip
    print("latency of one-row steps, one connection (one worker), c=1: at home against forwarded", flush=True)
    with ServerProcess(model, *device, "--workers", "2", "--warmup-runs", "2") as server:
        differences = []
        for number in range(1, args.rounds + 1):
            home, away = latency_ms(server, args.steps, rng, str(number))
            (home_p50, home_p90), (away_p50, away_p90) = quantiles(home), quantiles(away)
            differences.append(away_p50 - home_p50)
            print(
                f"  round {number}: at home p50 {home_p50:.3f} p90 {home_p90:.3f} ms; forwarded p50 {away_p50:.3f} "
                f"p90 {away_p90:.3f} ms; forwarded - at home at p50 {away_p50 - home_p50:+.3f} ms",
                flush=True,
            )
        print(f"  median difference at p50: {statistics.median(differences):+.3f} ms")
    if args.sequences:
        print(f"{args.sequences} sequences of 4 steps, each step on a new connection (gRPC and HTTP/REST)", flush=True)
        with ServerProcess(model, *device, "--warmup-runs", "0") as one:
            _, want = stepped_on_new_connections(one, args.sequences, 7)
        for workers in (int(n) for n in args.workers.split(",")):
            with ServerProcess(model, *device, "--workers", str(workers), "--warmup-runs", "0") as server:
                refused, got = stepped_on_new_connections(server, args.sequences, 7)
                before = sum(forwarded_by_worker(server).values())
            worst = max(float(np.abs(got[n] - want[n]).max()) for n in want if got[n] is not None)
            print(f"  {workers} workers: {refused} steps refused of {4 * args.sequences}; {before:.0f} forwarded; "
                  f"largest difference from one process's rows {worst:.2e}", flush=True)  # fmt: skip
    counts = [1, *(int(n) for n in args.workers.split(","))]
    workload = Workload(D, 1, 1, 1, attn_weights=False, sequence_length=64, connections=16)
    point = Point("closed", 64, args.duration, 1.0)
    print(f"steps a second, 64 sequences of 64 one-row steps at once from 16 connections, workers {counts}", flush=True)
    servers = [ServerProcess(model, *device, "--workers", str(n), "--warmup-runs", "2") for n in counts]
    for server in servers:
        server.start()
    try:
        rates: dict[int, list[float]] = {n: [] for n in counts}
        forwarded: dict[int, float] = dict.fromkeys(counts, 0.0)
        for number in range(1, args.rounds + 1):
            order = list(zip(counts, servers, strict=True))
            for n, server in order if number % 2 else reversed(order):
                before = sum(forwarded_by_worker(server).values()) if n > 1 else 0.0
                with LoadGenerator(server.url, 1) as load:
                    result = load.measure(workload, point)
                if result.errors:
                    raise SystemExit(f"{n} workers: refused steps {result.errors}")
                rates[n].append(result.throughput)
                if n > 1:
                    forwarded[n] = sum(forwarded_by_worker(server).values()) - before
            print(f"  round {number}: " + ", ".join(f"{n} worker(s) {rates[n][-1]:.0f}/s" for n in counts), flush=True)
        one = statistics.median(rates[1])
        for n in counts:
            median = statistics.median(rates[n])
            print(
                f"  {n} worker(s): {median:.0f} steps/s median, {median / one:.2f}x one worker"
                + (f" (last round: {forwarded[n]:.0f} steps forwarded)" if n > 1 else "")
            )
    finally:
        for server in servers:
            server.stop()


if __name__ == "__main__":
    main()
