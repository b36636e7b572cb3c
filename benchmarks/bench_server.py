"""Server latency at concurrency 1 against its two parts: in-process ORT and a bare gRPC echo.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_server.py [--model-dir DIR] [--calls 2000]

For each shape ([1,16,512] and [1,128,512], attention weights requested), in alternating rounds:
- ORT: session.run in this process (same threads as the server);
- echo: a bare grpc.aio server in its own process that answers every ModelInfer with the server's
  own response bytes for that request, unparsed: the cost of gRPC and the bytes alone;
- bare: the least a Python server on the same ORT session can do, in its own process: parse the
  request, ``np.frombuffer`` the query, ``session.run`` inline on the event loop, ``tobytes`` the
  outputs. No validation, no batching, no statistics. Like the server, its ORT runs after an idle
  gap (the client's turn), which costs ORT more than the back-to-back runs of the ORT row;
- server: mhaserve serve.
Echo, bare and server are called by the same client code (build request, call, parse with np.frombuffer).
The client runs on the same 2 cores as the server; its own cost is in both echo and server figures.
Prints p50/p99 per variant, server p50 / (ORT p50 + echo p50) and server p50 / bare p50. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from mhaserve.contract.model_dir import MODEL_FILE

SHAPES = [(1, 16, 512), (1, 128, 512)]
INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"


def echo_server(port: int, response_dir: Path) -> None:
    """Serve ModelInfer from raw bytes: the recorded response for a request of that size."""
    responses = {int(p.stem): p.read_bytes() for p in response_dir.glob("*.bin")}

    async def infer(request: bytes, context) -> bytes:
        return responses[len(request)]

    _serve_bytes(port, infer)


def bare_server(port: int, model_dir: Path, threads: int) -> None:
    """A minimal ModelInfer on ORT for a self-attention request: the floor for any Python gRPC server."""
    from mhaserve.protos.generated import grpc_service_pb2 as pb

    session = ort_session(model_dir / MODEL_FILE, threads)

    async def infer(request: bytes, context) -> bytes:
        parsed = pb.ModelInferRequest.FromString(request)
        x = np.frombuffer(parsed.raw_input_contents[0], np.float32).reshape(parsed.inputs[0].shape)
        mask = np.ones((1, 1, 1, x.shape[1]), dtype=bool)
        output, weights = session.run(None, {"query": x, "key": x, "value": x, "mask": mask})
        response = pb.ModelInferResponse(model_name=parsed.model_name, model_version="1")
        for name, array in (("output", output), ("attn_weights", weights)):
            response.outputs.add(name=name, datatype="FP32", shape=array.shape)
            response.raw_output_contents.append(array.tobytes())
        return response.SerializeToString()

    _serve_bytes(port, infer)


def _serve_bytes(port: int, infer) -> None:
    async def main():
        server = grpc.aio.server(
            options=[("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
        )
        live = b"\x08\x01"  # ServerLiveResponse(live=True), which load generators ask before they start

        async def server_live(request: bytes, context) -> bytes:
            return live

        handlers = {
            "ModelInfer": grpc.unary_unary_rpc_method_handler(infer),
            "ServerLive": grpc.unary_unary_rpc_method_handler(server_live),
        }
        handler = grpc.method_handlers_generic_handler("inference.GRPCInferenceService", handlers)
        server.add_generic_rpc_handlers((handler,))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        await server.wait_for_termination()

    asyncio.run(main())


def ort_session(model: Path | bytes, threads: int):
    """An ONNX model (its file, or its serialised bytes) on ONNX Runtime's CPU provider in this process,
    at ``threads`` intra-op threads and one inter-op thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def bytes_call(url: str) -> Callable[[bytes], bytes]:
    """ModelInfer at ``url``, serialised request in, serialised answer out: one client path for every server."""
    from mhaserve.client.grpc import _channel_options

    return grpc.insecure_channel(url, options=_channel_options(1 << 30)).unary_unary(INFER_METHOD)


def record_answers(infer: Callable[[bytes], bytes], shapes) -> tuple[dict, Path]:
    """Per shape, a random self-attention (query, request); and a folder of the server's answers to them by
    request size, which is what the echo server serves."""
    from mhaserve.client.grpc import build_infer_request

    requests, answers = {}, Path(tempfile.mkdtemp())
    for shape in shapes:
        query = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        request = build_infer_request("mha", query)
        requests[shape] = (query, request)
        raw = request.SerializeToString()
        (answers / f"{len(raw)}.bin").write_bytes(infer(raw))
    return requests, answers


def start_helper_process(role: str, argument: Path, threads: int) -> tuple[subprocess.Popen, str]:
    """This script as the echo or the bare server (``role``) in its own process, once it is ready; its address."""
    from mhaserve.server.process import free_port

    port = free_port()
    command = [sys.executable, __file__, "--threads", str(threads), f"--{role}-server", str(port), str(argument)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    process.stdout.readline()  # ready
    return process, f"127.0.0.1:{port}"


def start_helper(role: str, argument: Path, threads: int) -> tuple[subprocess.Popen, Callable[[bytes], bytes]]:
    """The helper server ``role`` started as ``start_helper_process`` starts it; its call."""
    process, url = start_helper_process(role, argument, threads)
    return process, bytes_call(url)


def percentile(values, q):
    return float(np.percentile(np.array(values) * 1e3, q))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the embedded default model")
    parser.add_argument("--calls", type=int, default=2000, help="calls per variant and shape")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--echo-server", nargs=2, metavar=("PORT", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument("--bare-server", nargs=2, metavar=("PORT", "MODEL_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.echo_server:
        echo_server(int(args.echo_server[0]), Path(args.echo_server[1]))
        return
    if args.bare_server:
        bare_server(int(args.bare_server[0]), Path(args.bare_server[1]), args.threads)
        return

    import onnxruntime as ort

    from mhaserve.client.grpc import parse_infer_response
    from mhaserve.export.default_model import ensure_default_model
    from mhaserve.protos.generated import grpc_service_pb2 as pb
    from mhaserve.server.process import ServerProcess

    model_dir = args.model_dir or ensure_default_model()
    session = ort_session(model_dir / MODEL_FILE, args.threads)
    server = ServerProcess(model_dir, "--intra-op-threads", str(args.threads)).start()
    infer = bytes_call(server.url)
    requests, answers = record_answers(infer, SHAPES)
    helpers, calls = [], {}
    for role, argument in (("echo", answers), ("bare", model_dir)):
        process, calls[role] = start_helper(role, argument, args.threads)
        helpers.append(process)

    def client_call(call, request):
        def once():
            response = pb.ModelInferResponse.FromString(call(request.SerializeToString()))
            parse_infer_response(response)

        return once

    print(f"onnxruntime {ort.__version__}, server and ORT at {args.threads} threads, client on the same cores")
    print(f"{'shape':<14} {'variant':<7} {'p50 ms':>8} {'p99 ms':>8}")
    try:
        for shape in SHAPES:
            x, request = requests[shape]
            mask = np.ones((1, 1, 1, shape[1]), dtype=bool)
            variants = {
                "ORT": lambda x=x, mask=mask: session.run(None, {"query": x, "key": x, "value": x, "mask": mask}),
                "echo": client_call(calls["echo"], request),
                "bare": client_call(calls["bare"], request),
                "server": client_call(infer, request),
            }
            times = {name: [] for name in variants}
            for fn in variants.values():
                for _ in range(50):
                    fn()
            per_round = max(1, args.calls // args.rounds)
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    for _ in range(per_round):
                        t = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - t)
            label = str(list(shape))
            for name in variants:
                p50, p99 = percentile(times[name], 50), percentile(times[name], 99)
                print(f"{label:<14} {name:<7} {p50:8.3f} {p99:8.3f}")
            ratio = statistics.median(times["server"]) / (
                statistics.median(times["ORT"]) + statistics.median(times["echo"])
            )
            print(f"{label:<14} server p50 / (ORT p50 + echo p50) = {ratio:.2f}")
            ratio = statistics.median(times["server"]) / statistics.median(times["bare"])
            print(f"{label:<14} server p50 / bare p50 = {ratio:.2f}", flush=True)
    finally:
        for helper in helpers:
            helper.terminate()
        server.stop()


if __name__ == "__main__":
    main()
