"""What reading a gRPC request in turns costs the event loop, on a bare grpc.aio server with no model.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_grpc_read.py [--rounds 5] [--callers 16] [--seconds 4]

One method answering a 40 KB reply to a 32 KB request (about a `[1,16,512]` call), served four ways in turn,
each in a fresh server in this process, each round in a fresh order: as grpcio's unary-unary handler (the
request received with the call), request-streaming with a bare ``context.read()``, and request-streaming with
the server's ``RequestReader`` (the receipt that keeps stalled senders from holding others and bounds what
requests take while they arrive), one first read at a time as served and any number at once. A client process
makes calls from ``--callers`` coroutines over two connections. Per way: calls a second and the event loop's
CPU per call (the thread that bounds such a server), medians over the rounds, and each against the bare read.
Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import grpc

from mhaserve.server.grpc.receipt import ReceivingTurns, RequestReader

REQUEST, REPLY = b"x" * 32_800, b"y" * 40_000
RECEIVE_LIMIT = 168 << 20  # the default model's (a whole batch of 512-long requests)
RECEIVING_BYTES = 512 << 20  # the default --max-receiving-bytes: one receiving turn
WAYS = ("unary-unary", "bare read", "reader", "reader, first reads at once")


class _EachCallItsOwnConnection:
    """A call's context as the reader sees it, its peer made unique: first reads are also one per connection (the
    client's callers share two), so this and a reader allowing any number of first reads at once lift both limits."""

    def __init__(self, context):
        self._context = context

    def peer(self) -> str:
        return str(id(self))

    async def read(self):
        return await self._context.read()

    async def abort(self, *args):
        return await self._context.abort(*args)


def handler(way: str):
    identity = lambda raw: raw  # noqa: E731
    if way == "unary-unary":

        async def unary(request, context):
            return REPLY

        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=identity, response_serializer=identity)
    at_once = 10**6 if way == "reader, first reads at once" else 1
    reader = RequestReader(
        ReceivingTurns(RECEIVING_BYTES, RECEIVE_LIMIT, 1.0), RECEIVE_LIMIT, 30.0, 0.025, first_reads=at_once
    )

    async def streaming(_, context):
        if way == "bare read":
            await context.read()
        elif way == "reader":
            await reader.read(context)
        else:
            await reader.read(_EachCallItsOwnConnection(context))
        return REPLY

    return grpc.stream_unary_rpc_method_handler(streaming, request_deserializer=identity, response_serializer=identity)


async def serve(way: str) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", RECEIVE_LIMIT), ("grpc.http2.bdp_probe", 0)])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("bench.Read", {"Call": handler(way)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


async def calls(port: int, callers: int, seconds: float, connections: int = 2) -> int:
    """The client process's part: calls made in ``seconds``."""
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(connections)
    ]
    made, stop = 0, time.monotonic() + seconds

    async def caller(number: int) -> None:
        nonlocal made
        call = channels[number % connections].unary_unary("/bench.Read/Call")
        while time.monotonic() < stop:
            await call(REQUEST)
            made += 1

    await asyncio.gather(*(caller(n) for n in range(callers)))
    return made


async def measure(args) -> dict[str, list[tuple[float, float]]]:
    results: dict[str, list[tuple[float, float]]] = {way: [] for way in WAYS}
    for round_number in range(args.rounds):
        order = list(WAYS[round_number % len(WAYS) :] + WAYS[: round_number % len(WAYS)])
        for way in order:
            server, port = await serve(way)
            client = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--client", str(port), str(args.callers), str(args.seconds),
                stdout=subprocess.PIPE,
            )  # fmt: skip
            loop_cpu, wall = time.thread_time(), time.monotonic()
            out, _ = await client.communicate()
            loop_cpu, wall = time.thread_time() - loop_cpu, time.monotonic() - wall
            made = int(out)
            results[way].append((made / wall, loop_cpu / made * 1e6))
            await server.stop(None)
    return results


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        port, callers, seconds = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
        print(asyncio.run(calls(port, callers, seconds)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    results = asyncio.run(measure(args))
    bare_rate = statistics.median(rate for rate, _ in results["bare read"])
    bare_cpu = statistics.median(cpu for _, cpu in results["bare read"])
    print(f"{args.callers} callers, {args.rounds} rounds of {args.seconds:g} s, medians (rounds in brackets):")
    for way, rounds in results.items():
        rate, cpu = statistics.median(r for r, _ in rounds), statistics.median(c for _, c in rounds)
        print(f"{way:>28}: {rate:7.0f} calls/s ({rate / bare_rate:.2f}x the bare read), event loop {cpu:6.1f} us "
              f"a call ({cpu - bare_cpu:+.1f}) [{', '.join(f'{r:.0f}' for r, _ in rounds)}]")  # fmt: skip


if __name__ == "__main__":
    main()
