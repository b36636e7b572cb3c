"""What stalled senders cost other clients, another revision against the working tree's, side by side in one run.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_hostile.py --baseline REV [--calls 20] [--deadline 2]
        [--idle-streams 64]

Both revisions serve the embedded default model (512/8) with their defaults, each in its own process, one after
the other. For each count of stalled senders (1, 4 and 16, each on a connection of its own, half sending their
headers only and half their headers and half a [1,128,512] request, every refused one reopened at once), another
client makes ``--calls`` rounds, each one small [1,16,512] ModelInfer and a ServerLive, ModelReady and
ModelMetadata, and a new ModelStreamInfer stream of one [1,16,512] request, every call with a deadline of
``--deadline`` seconds; then the same over HTTP/REST (the stalled bodies declare 150 MiB and send 1 KB). With
``--idle-streams N``, N streams over four connections of their own are opened, answered once and left idle for the
whole measurement, beside the stalled senders. Printed per point: p50, p99 and max of each kind of call in ms, and
how many missed their deadline. Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import threading
import time
import urllib.request

import grpc
import numpy as np
from bench_revisions import baseline_checkout

from mhaserve.client.grpc import build_infer_request
from mhaserve.export.default_model import ensure_default_model
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.server.process import ServerProcess
from mhaserve.testing.raw_grpc import ZeroWindowGrpcClient

D = 512
STALLERS = (1, 4, 16)


class Stallers:
    """``count`` senders that stall, each on a connection of its own, reopening a call as soon as one is refused."""

    def __init__(self, url: str, count: int):
        self.message = build_infer_request("mha", np.ones((1, 128, D), np.float32)).SerializeToString()
        self.clients = [ZeroWindowGrpcClient(url) for _ in range(count)]
        self.calls = [self._open(number) for number in range(count)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep_stalling, daemon=True)
        self._thread.start()

    def _open(self, number: int) -> int:
        stop_after = 0 if number % 2 else len(self.message) // 2
        return self.clients[number].call(self.message, stop_after=stop_after)

    def _keep_stalling(self) -> None:
        while not self._stop.is_set():
            for number, client in enumerate(self.clients):
                client.pump(0.05)
                if self.calls[number] in client.statuses:  # refused: reopen at once
                    self.calls[number] = self._open(number)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for client in self.clients:
            client.close()


class HttpStallers:
    """``count`` HTTP clients whose bodies declare 150 MiB and stop after 1 KB."""

    def __init__(self, http_url: str, count: int):
        host, port = http_url.removeprefix("http://").rsplit(":", 1)
        head = f"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: {150 << 20}\r\n\r\n".encode()
        self.sockets = []
        for _ in range(count):
            connection = socket.create_connection((host, int(port)), timeout=10)
            connection.sendall(head + b"{" + b" " * 1023)
            self.sockets.append(connection)

    def close(self) -> None:
        for connection in self.sockets:
            connection.close()


def timed(call) -> float:
    """Seconds the call took, or inf when it failed (its deadline passed, or it was refused)."""
    started = time.perf_counter()
    try:
        call()
    except (grpc.RpcError, OSError):
        return float("inf")
    return time.perf_counter() - started


def _answered_or_over_the_cap(stub, request, deadline: float) -> None:
    """A new stream's one request answered, or the stream refused at once for the streams' cap (the documented
    answer when as many streams are open as --max-inference-streams allows); anything else raises."""
    try:
        list(stub.ModelStreamInfer(iter([request]), timeout=deadline))
    except grpc.RpcError as error:
        if error.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or "--max-inference-streams" not in error.details():
            raise


def grpc_rounds(url: str, calls: int, deadline: float) -> dict[str, list[float]]:
    request = build_infer_request("mha", np.ones((1, 16, D), np.float32))
    kinds = {
        "ModelInfer": lambda stub: stub.ModelInfer(request, timeout=deadline),
        "ServerLive": lambda stub: stub.ServerLive(pb.ServerLiveRequest(), timeout=deadline),
        "ModelReady": lambda stub: stub.ModelReady(pb.ModelReadyRequest(name="mha"), timeout=deadline),
        "ModelMetadata": lambda stub: stub.ModelMetadata(pb.ModelMetadataRequest(name="mha"), timeout=deadline),
        "new stream": lambda stub: _answered_or_over_the_cap(stub, request, deadline),
    }
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    with grpc.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        grpc.channel_ready_future(channel).result(timeout=10)  # connected
        for _ in range(calls):
            for kind, call in kinds.items():
                seconds[kind].append(timed(lambda call=call: call(stub)))
    return seconds


def http_rounds(http_url: str, calls: int, deadline: float) -> dict[str, list[float]]:
    body = json.dumps({"inputs": [{"name": "query", "shape": [1, 16, D], "datatype": "FP32",
                                   "data": [0.5] * (16 * D)}], "outputs": [{"name": "output"}]}).encode()  # fmt: skip

    def infer():
        request = urllib.request.Request(http_url + "/v2/models/mha/infer", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=deadline) as answer:
            answer.read()

    def ready():
        with urllib.request.urlopen(http_url + "/v2/models/mha/ready", timeout=deadline) as answer:
            answer.read()

    seconds: dict[str, list[float]] = {"HTTP infer": [], "HTTP ready": []}
    for _ in range(calls):
        seconds["HTTP infer"].append(timed(infer))
        seconds["HTTP ready"].append(timed(ready))
    return seconds


def shown(values: list[float]) -> str:
    finite = sorted(v for v in values if v != float("inf"))
    missed = len(values) - len(finite)
    if not finite:
        return f"{'-':>7} {'-':>7} {'-':>7} missed {missed}/{len(values)}"
    p99 = finite[min(len(finite) - 1, round(0.99 * (len(finite) - 1)))] * 1000
    return f"{statistics.median(finite) * 1000:7.1f} {p99:7.1f} {finite[-1] * 1000:7.1f} missed {missed}/{len(values)}"


class IdleStreams:
    """``count`` ModelStreamInfer streams over four connections of their own, each answered once, then left idle."""

    def __init__(self, url: str, count: int):
        import queue

        request = build_infer_request("mha", np.ones((1, 4, D), np.float32))
        self.channels = [grpc.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(4)]
        self.streams = []
        for number in range(count):
            sending = queue.Queue()
            stub = pb_grpc.GRPCInferenceServiceStub(self.channels[number % 4])
            answers = stub.ModelStreamInfer(iter(sending.get, None))
            sending.put(request)
            next(answers)
            self.streams.append((sending, answers))

    def close(self) -> None:
        for sending, _ in self.streams:
            sending.put(None)
        for channel in self.channels:
            channel.close()


def measure(name: str, server: ServerProcess, args) -> None:
    idle = IdleStreams(server.url, args.idle_streams) if args.idle_streams else None
    try:
        measure_stalled(name, server, args)
    finally:
        if idle is not None:
            idle.close()


def measure_stalled(name: str, server: ServerProcess, args) -> None:
    for count in STALLERS:
        stallers = Stallers(server.url, count)
        time.sleep(0.5)
        try:
            seconds = grpc_rounds(server.url, args.calls, args.deadline)
        finally:
            stallers.close()
        http_stallers = HttpStallers(server.http_url, count)
        try:
            seconds.update(http_rounds(server.http_url, args.calls, args.deadline))
        finally:
            http_stallers.close()
        for kind, values in seconds.items():
            print(f"{name:>8} {count:>3} stalled | {kind:<14} {shown(values)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--deadline", type=float, default=2.0, help="each call's deadline, seconds")
    parser.add_argument("--idle-streams", type=int, default=0, help="streams left idle beside the stalled senders")
    parser.add_argument("--current-only", action="store_true", help="skip the baseline (its calls wait out deadlines)")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    print(f"{'server':>8} {'':>11} | {'call':<14} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}")
    if not args.current_only:
        with baseline_checkout(args.baseline) as (baseline_env, _), ServerProcess(model_dir, env=baseline_env) as old:
            measure("baseline", old, args)
    with ServerProcess(model_dir) as current:
        measure("current", current, args)


if __name__ == "__main__":
    main()
