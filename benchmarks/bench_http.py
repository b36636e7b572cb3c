"""HTTP/REST against gRPC on this server, and against the peers' HTTP endpoints: one run, side by side.

    ../shared/peers/setup_peers.sh                     # once, with PEERS_DIR=/tmp/peers/.peers (for the peers)
    .venv/bin/python benchmarks/bench_http.py [--peers-dir /tmp/peers/.peers] [--seconds 4]

The peers' start script takes /tmp/bench.lock itself, so this script takes it only around the
measurements, once every server is up (wrapping it in flock would deadlock).

One client for every server: a closed loop of asyncio callers in this process (aiohttp for HTTP with
Triton's binary tensor data extension both ways, grpc.aio for gRPC), each request built beforehand,
so every server pays the same client cost (the client shares the two cores; its CPU is printed).
Shapes [1,16,512] and [1,128,512], concurrency 1 and 16, with and without attention weights on mhaserve;
with weights against the peers (PyTriton's Triton on HTTP 8000, MLServer's REST on 8080, each serving
the same module's single-input export). Rounds alternate between servers; the median round is kept.
Not a test: it prints numbers; BENCHMARKS.md records them.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

from mhaserve.client.grpc import build_infer_request
from mhaserve.client.http import build_http_infer_body
from mhaserve.export.default_model import ensure_default_model
from mhaserve.server.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
PEERS = (ROOT / ".." / "shared" / "peers").resolve()


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def closed_loop(send, concurrency: int, seconds: float, warmup: float) -> dict:
    latencies, errors = [], 0
    start = time.perf_counter()
    measure_from, end = start + warmup, start + warmup + seconds
    cpu_marks = []

    async def caller():
        nonlocal errors
        while (sent := time.perf_counter()) < end:
            ok = await send()
            done = time.perf_counter()
            if sent >= measure_from and done <= end:
                if ok:
                    latencies.append(done - sent)
                else:
                    errors += 1

    async def mark():
        await asyncio.sleep(warmup)
        cpu_marks.append(cpu_s())

    marker = asyncio.create_task(mark())
    await asyncio.gather(*(caller() for _ in range(concurrency)))
    await marker
    ms = np.array(latencies) * 1000
    return {
        "throughput": len(ms) / seconds,
        "p50": float(np.percentile(ms, 50)) if len(ms) else float("nan"),
        "p99": float(np.percentile(ms, 99)) if len(ms) else float("nan"),
        "errors": errors,
        "client_cpu": (cpu_s() - cpu_marks[0]) / seconds,
    }


def http_sender(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict):
    async def send() -> bool:
        async with session.post(url, data=body, headers=headers) as response:
            await response.read()
            return response.status == 200

    return send


def grpc_sender(stub, request):
    import grpc

    async def send() -> bool:
        try:
            await stub.ModelInfer(request, timeout=60)
            return True
        except grpc.aio.AioRpcError:
            return False

    return send


def peer_http_body(query: np.ndarray, input_name: str, binary: bool) -> tuple[bytes, dict]:
    """The peers' single-input model: input x, outputs output and attn_weights."""
    outputs = [{"name": n, "parameters": {"binary_data": binary}} for n in ("output", "attn_weights")]
    if not binary:
        document = {"inputs": [{"name": input_name, "shape": list(query.shape), "datatype": "FP32",
                                "data": query.ravel().tolist()}], "outputs": outputs}  # fmt: skip
        return json.dumps(document).encode(), {"Content-Type": "application/json"}
    document = {"inputs": [{"name": input_name, "shape": list(query.shape), "datatype": "FP32",
                            "parameters": {"binary_data_size": query.nbytes}}], "outputs": outputs}  # fmt: skip
    header = json.dumps(document).encode()
    return header + query.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def start_peer(peers_dir: Path, name: str, url: str, *command: str, env=None) -> None:
    subprocess.run([str(PEERS / "start_peer.sh"), name, url, *command], check=True,
                   env={**os.environ, "PEERS_DIR": str(peers_dir), **(env or {})})  # fmt: skip


def stop_peer(peers_dir: Path, name: str) -> None:
    subprocess.run([str(PEERS / "stop_peer.sh"), name], env={**os.environ, "PEERS_DIR": str(peers_dir)})


async def measure(targets: dict, shapes, concurrencies, seconds: float, warmup: float, rounds: int) -> list[dict]:
    """targets: name -> (function(shape, weights) -> sender factory, weights settings it supports)."""
    rows = []
    for shape in shapes:
        query = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
        for weights in (True, False):
            for concurrency in concurrencies:
                runs = {name: [] for name, (_, settings) in targets.items() if weights in settings}
                for _ in range(rounds):
                    for name in runs:
                        send = targets[name][0](query, weights)
                        runs[name].append(await closed_loop(send, concurrency, seconds, warmup))
                for name, results in runs.items():
                    best = sorted(results, key=lambda r: r["throughput"])[len(results) // 2]
                    rows.append({"server": name, "shape": shape, "weights": weights, "c": concurrency, **best})
                    label = (
                        f"{name:>22} {str(list(shape)):>12} weights={'yes' if weights else 'no ':3} c={concurrency:<3}"
                    )
                    print(f"{label}"
                          f" {best['throughput']:8.1f}/s p50 {best['p50']:7.2f} ms p99 {best['p99']:7.2f} ms "
                          f"errors {best['errors']} client {best['client_cpu']:.2f} cores", flush=True)  # fmt: skip
    return rows


async def run(args) -> None:
    import grpc

    from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

    server = ServerProcess(ensure_default_model(), "--port", "8301", "--http-port", "8300").start()
    sessions = []

    async def session() -> aiohttp.ClientSession:
        made = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        sessions.append(made)
        return made

    http = await session()
    channel = grpc.aio.insecure_channel(server.url, options=[("grpc.max_receive_message_length", 1 << 30)])
    stub = pb_grpc.GRPCInferenceServiceStub(channel)
    targets = {
        "mhaserve gRPC": (lambda q, w: grpc_sender(stub, build_infer_request("mha", q, attn_weights=w)), (True, False)),
        "mhaserve HTTP": (
            lambda q, w: http_sender(
                http, f"{server.http_url}/v2/models/mha/infer", *build_http_infer_body(q, attn_weights=w)
            ),
            (True, False),
        ),
    }  # fmt: skip
    peers = []
    if args.peers_dir:
        start_peer(args.peers_dir, "pytriton-http", "127.0.0.1:8001", "serve_pytriton.sh")
        peers.append("pytriton-http")
        start_peer(args.peers_dir, "mlserver-http", "127.0.0.1:8081", "serve_mlserver.sh", "nobatch",
                   env={"PARALLEL_WORKERS": "0"})  # fmt: skip
        peers.append("mlserver-http")
        targets["PyTriton HTTP (binary)"] = (
            lambda q, w: http_sender(http, "http://127.0.0.1:8000/v2/models/mha/infer", *peer_http_body(q, "x", True)),
            (True,),
        )
        targets["MLServer HTTP (JSON)"] = (
            lambda q, w: http_sender(http, "http://127.0.0.1:8080/v2/models/mha/infer", *peer_http_body(q, "x", False)),
            (True,),
        )
    try:
        with open(os.environ.get("BENCH_LOCK", "/tmp/bench.lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            shapes = [(1, 16, 512), (1, 128, 512)]
            rows = await measure(targets, shapes, (1, 16), args.seconds, args.warmup, args.rounds)
    finally:
        for made in sessions:
            await made.close()
        await channel.close()
        server.stop()
        for name in peers:
            stop_peer(args.peers_dir, name)
    print("\nratios (same shape, weights and concurrency):")
    by_key = {(r["server"], r["shape"], r["weights"], r["c"]): r for r in rows}
    for (name, shape, weights, c), row in by_key.items():
        if name == "mhaserve HTTP":
            continue
        ours = by_key.get(("mhaserve HTTP", shape, weights, c))
        if ours and row["throughput"] and ours["throughput"]:
            ratio, p50 = ours["throughput"] / row["throughput"], ours["p50"] / row["p50"]
            print(f"  mhaserve HTTP vs {name:>22} {list(shape)} weights={'yes' if weights else 'no'} c={c}: "
                  f"throughput x{ratio:.2f}, p50 x{p50:.2f}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers-dir", type=Path, default=None, help="the peers' PEERS_DIR (omit: mhaserve only)")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
