"""Honest callers on a busy server: are any refused? Another revision against the working tree's, one after the other.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_honest_callers.py [--baseline REV] [--runs 3]
        [--seconds 20] [--steppers 64] [--callers 64] [--lengths 16..128] [--weights] [--stalled 16] [--busy 0]
        [-- SERVE_FLAGS...]

Each revision serves the embedded default model (512/8) with its defaults and SERVE_FLAGS, in its own process
(``--grpc-first-read-ms 1`` makes every request's first read short for its server, as a busy host does). Per run,
at once: ``--steppers`` asyncio callers (one process, the project's AsyncClient, no retries), each stepping sequences (a
first step of [1,8,512], then one-row steps, a new sequence every 16 steps); ``--callers`` tritonclient threads
in four processes (threads sharing each process's channel, as tritonclient's users call) sending stateless
[1,L,512] rows, L drawn from ``--lengths`` (with every head's weights asked for too with ``--weights``: large
answers, which fill the memory budget); ``--stalled`` senders that stall part-way (half their headers only, half
half a [1,128,512] request, each reopened once refused: benchmarks/bench_hostile.py's); and ``--busy`` busy loops
sharing the cores.
Printed per run: the honest calls answered and refused, by status, with one refusal's message. Not a test:
BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import random
import threading
import time

import numpy as np
from bench_hostile import Stallers
from bench_revisions import baseline_checkout

from mhaserve.cli.common import length_range
from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.process import ServerProcess

D = 512
CALLER_PROCESSES = 4


def busy(stop) -> None:
    while not stop.is_set():
        pass


def stateless(url: str, threads: int, seconds: float, lengths: tuple[int, int], weights: bool, out) -> None:
    import tritonclient.grpc as triton

    client = triton.InferenceServerClient(url)
    counts: collections.Counter = collections.Counter()
    said: dict[str, str] = {}

    def calls(seed: int) -> None:
        rng, end = random.Random(seed), time.monotonic() + seconds
        while time.monotonic() < end:
            length = rng.randint(*lengths)
            query = triton.InferInput("query", [1, length, D], "FP32")
            query.set_data_from_numpy(np.ones((1, length, D), np.float32))
            outputs = [triton.InferRequestedOutput(name) for name in ("output", "attn_weights")[: 1 + weights]]
            try:
                client.infer("mha", [query], outputs=outputs, client_timeout=30)
                counts["OK"] += 1
            except triton.InferenceServerException as error:
                counts[str(error.status())] += 1
                said[str(error.status())] = str(error)[:240]

    workers = [threading.Thread(target=calls, args=(n,)) for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    out.put((dict(counts), said))


def stepping(url: str, steppers: int, seconds: float, out) -> None:
    import grpc

    from mhaserve.client import AsyncClient
    from mhaserve.client.grpc import NO_RETRIES

    counts: collections.Counter = collections.Counter()
    said: dict[str, str] = {}

    async def stepper(client) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            async with client.sequence() as sequence:
                for number in range(16):
                    rows = np.ones((1, 8 if number == 0 else 1, D), np.float32)
                    try:
                        await sequence.step(rows, end=number == 15, attn_weights=False)
                        counts["OK"] += 1
                    except grpc.RpcError as error:
                        counts[error.code().name] += 1
                        said[error.code().name] = (error.details() or "")[:240]
                        break

    async def main() -> None:
        async with AsyncClient(url, retry=NO_RETRIES) as client:
            await asyncio.gather(*(stepper(client) for _ in range(steppers)))

    asyncio.run(main())
    out.put((dict(counts), said))


def one_run(url: str, args) -> tuple[collections.Counter, collections.Counter, dict[str, str]]:
    stop, out = multiprocessing.Event(), multiprocessing.Queue()
    loops = [multiprocessing.Process(target=busy, args=(stop,)) for _ in range(args.busy)]
    stallers = Stallers(url, args.stalled) if args.stalled else None
    processes = [multiprocessing.Process(target=stepping, args=(url, args.steppers, args.seconds, out))]
    processes += [
        multiprocessing.Process(
            target=stateless,
            args=(url, args.callers // CALLER_PROCESSES, args.seconds, args.lengths, args.weights, out),
        )
        for _ in range(CALLER_PROCESSES)
    ]
    for process in [*loops, *processes]:
        process.start()
    results = [out.get() for _ in processes]
    for process in processes:
        process.join()
    stop.set()
    for loop in loops:
        loop.join()
    if stallers is not None:
        stallers.close()
    steps, rows, said = collections.Counter(results[0][0]), collections.Counter(), {}
    for counts, messages in results[1:]:
        rows.update(counts)
        said.update(messages)
    said.update(results[0][1])
    return steps, rows, said


def measure(name: str, server: ServerProcess, args) -> None:
    for run in range(1, args.runs + 1):
        steps, rows, said = one_run(server.url, args)
        refused = {k: v for k, v in (steps + rows).items() if k != "OK"}
        print(f"{name:>8} run {run}: steps OK {steps['OK']}, rows OK {rows['OK']}, refused {refused or 0}", flush=True)
        for status, message in said.items():
            print(f"{'':>8}   {status}: {message}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a revision to measure first (e.g. main)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--steppers", type=int, default=64)
    parser.add_argument("--callers", type=int, default=64)
    parser.add_argument("--lengths", type=length_range, default=(16, 128), help="LO..HI: the stateless rows' lengths")
    parser.add_argument("--weights", action="store_true", help="the stateless callers ask for every head's weights")
    parser.add_argument("--stalled", type=int, default=16)
    parser.add_argument("--busy", type=int, default=0)
    parser.add_argument("flags", nargs="*", help="flags both servers get (after --)")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    if args.baseline:
        with (
            baseline_checkout(args.baseline) as (baseline_env, _),
            ServerProcess(model_dir, *args.flags, env=baseline_env) as old,
        ):
            measure("baseline", old, args)
    with ServerProcess(model_dir, *args.flags) as current:
        measure("current", current, args)


if __name__ == "__main__":
    main()
