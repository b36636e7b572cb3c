"""Health-check latency while other clients send large messages as fast as they can: mhaserve against a bare
grpc.aio server that only receives them, on the same cores. The bare server does nothing with a message but
refuse it, so what its health checks wait is what receiving that traffic costs any Python gRPC server
here: the ceiling below which mhaserve's own work cannot push the figure.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_health.py

Three sender processes (raw gRPC calls of one pre-serialised ModelInferRequest each), the health checker in
this process alone (one Check every 20 ms for --seconds after a 1 s start), each server in its own process.
Traffic: none; 8 MiB of typed BOOL mask values (converted value by value by mhaserve, then refused for its
length); the same mask as 8 MiB of raw bytes (likewise refused). Not a test: it prints p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import subprocess
import sys

import grpc
import numpy as np
from grpc_health.v1 import health_pb2_grpc

from mhaserve.loadtest.checked_load import health_latencies_under_load
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.server.process import ServerProcess

MESSAGE_LIMIT = 64 << 20


def mask_message(d_model: int, typed: bool) -> bytes:
    request = pb.ModelInferRequest(model_name="mha")
    query = request.inputs.add(name="query", datatype="FP32", shape=[1, 4, d_model])
    mask = request.inputs.add(name="mask", datatype="BOOL", shape=[1, 2048, 4096])
    ones = np.ones(2048 * 4096, dtype=bool)
    if typed:
        query.contents.fp32_contents.extend([0.5] * (4 * d_model))
        mask.contents.bool_contents.extend(ones.tolist())
    else:
        request.raw_input_contents.extend([np.full(4 * d_model, 0.5, np.float32).tobytes(), ones.tobytes()])
    return request.SerializeToString()


async def serve_bare(port: int) -> None:
    """Health, and a ModelInfer that takes the message as bytes and refuses it: no parsing, no model."""
    from grpc_health.v1 import health

    async def refuse(raw: bytes, context) -> bytes:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{len(raw)} bytes refused")

    handler = grpc.unary_unary_rpc_method_handler(refuse)
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MESSAGE_LIMIT)])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "inference.GRPCInferenceService", {"ModelInfer": handler})])  # fmt: skip
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--traffic", action="append", choices=("none", "typed mask", "raw mask"))
    parser.add_argument("--serve-bare", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_bare:
        asyncio.run(serve_bare(args.serve_bare))
        return 0

    from mhaserve.export.default_model import ensure_default_model

    model_dir = ensure_default_model()
    d_model = 512
    traffic = {"none": None, "typed mask": mask_message(d_model, True), "raw mask": mask_message(d_model, False)}
    traffic = {kind: message for kind, message in traffic.items() if kind in (args.traffic or traffic)}
    port = free_port()
    bare = subprocess.Popen([sys.executable, __file__, "--serve-bare", str(port)], stdout=subprocess.PIPE, text=True)
    assert bare.stdout.readline().strip() == "ready"
    try:
        with ServerProcess(model_dir, "--max-message-bytes", str(MESSAGE_LIMIT)) as server:
            targets = {"mhaserve": server.url, "bare grpc.aio": f"127.0.0.1:{port}"}
            print("round | traffic | server | checks | p50 ms | p99 ms")
            for round_ in range(1, args.rounds + 1):
                for kind, message in traffic.items():
                    for name, url in targets.items():
                        latencies = sorted(health_latencies_under_load(url, message, args.seconds)[0])
                        p50 = statistics.median(latencies)
                        p99 = latencies[int(0.99 * (len(latencies) - 1))]
                        print(f"{round_} | {kind} | {name} | {len(latencies)} | {p50 * 1e3:.1f} | {p99 * 1e3:.1f}",
                              flush=True)  # fmt: skip
    finally:
        bare.terminate()
        bare.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
