"""System shared memory against the socket, on this server and on Triton (PyTriton's tritonserver from
../shared/peers), all driven by the same perf_analyzer, side by side in one run.

    PEERS_DIR=/tmp/peers/.peers ../shared/peers/setup_peers.sh     # once (for Triton)
    .venv/bin/python benchmarks/bench_shared_memory.py --peers-dir /tmp/peers/.peers

Shapes [1,128,512] and [1,512,512], every output the model lists (perf_analyzer asks for all: mhaserve's
attention weights' mean too), concurrency 1 and 16; perf_analyzer
--shared-memory none and system (inputs and outputs in regions it registers). perf_analyzer's shared memory does
not support optional inputs, so mhaserve gets query, key, value and a [1, L, L] BOOL mask (the same values for
query, key and value), and Triton its one input x: mhaserve's requests carry three times the input bytes and the mask.
PyTriton runs from a copy of the peers' scripts with its shared-memory endpoints open (PyTriton 0.7 restricts
them behind a random token by default, which perf_analyzer cannot send).
Then mhaserve's own Python client, one call at a time (its outputs read back from the region). Prints a
markdown table and the ratios, and where mhaserve's time goes at concurrency 1: its own statistics over each
perf_analyzer run (the run as served; the rest of the server's time), what lies outside the server (the
client and the round trip), and the floor: ONNX Runtime's run of the same request in this process, with an
idle gap before each run as a served call has. Every timed step holds /tmp/bench.lock.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_serving import PEERS_SCRIPTS as PEERS
from bench_serving import bench_lock

from mhaserve.server.process import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
PERF_ANALYZER = Path(os.environ.get("PERF_ANALYZER", ROOT / ".tools/perf_analyzer/run"))
D = 512
WEIGHTS_BYTES = {128: 4 * 8 * 128 * 128, 512: 4 * 8 * 512 * 512}


def input_data(folder: Path, length: int, names: tuple[str, ...], batched: bool) -> Path:
    """perf_analyzer's JSON input data: one random request (finite values; its own random data holds NaN)."""
    query = np.random.default_rng(length).standard_normal((1, length, D)).astype(np.float32)
    shape = [length, D] if batched else [1, length, D]
    step = {name: {"content": query.ravel().tolist(), "shape": shape} for name in names}
    if "mask" in names:
        step["mask"] = {"content": [True] * length * length, "shape": [1, length, length]}
    path = folder / f"{'-'.join(names)}-{length}.json"
    path.write_text(json.dumps({"data": [step]}))
    return path


def perf_analyzer(url: str, data: Path, length: int, concurrency: int, shared_memory: str, batched: bool, seconds):
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "pa.csv"
        command = [
            str(PERF_ANALYZER), "-m", "mha", "-i", "grpc", "-u", url, "--input-data", str(data),
            "--shared-memory", shared_memory, "--output-shared-memory-size", str(WEIGHTS_BYTES[length]),
            "--concurrency-range", str(concurrency), "--measurement-interval", str(int(seconds * 1000)),
            "--stability-percentage", "1000", "--max-trials", "3", "-f", str(report),
            *(("-b", "1") if batched else ()),
        ]  # fmt: skip
        with bench_lock():
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            return {"error": (done.stdout + done.stderr).strip().splitlines()[-1]}
        row = next(csv.DictReader(report.open()))
        return {"infer_per_s": float(row["Inferences/Second"]), "p50_ms": int(row["p50 latency"]) / 1000}


def server_phases(url: str):
    """The server's cumulative success count and time, and its run (compute) time, for one model."""
    from mhaserve.client import Client

    with Client(url) as client:
        stats = client.statistics().inference_stats
    return stats.success.count, stats.success.ns, stats.compute_infer.ns


def onnx_runtime_floor(length: int, runs: int = 40, gap_s: float = 0.005) -> float:
    """p50 ms of the served session's run of perf_analyzer's request (query, key, value, an all-True mask; output
    and attention weights), in this process, after an idle gap like a served call's."""
    from mhaserve.export.default_model import ensure_default_model
    from mhaserve.server.graphs import AttentionGraphs

    session = AttentionGraphs.open(ensure_default_model(), device="cpu")
    query = np.random.default_rng(length).standard_normal((1, length, D)).astype(np.float32)
    mask = np.ones((1, 1, length, length), dtype=bool)
    took = []
    with bench_lock():
        for run in range(runs + 5):
            time.sleep(gap_s)
            started = time.perf_counter()
            session.run(["output", "attn_weights"], query, query, query, mask)
            if run >= 5:
                took.append((time.perf_counter() - started) * 1000)
    return float(np.median(took))


def python_client(url: str, lengths: list[int], calls: int) -> None:
    """mhaserve's own Client, one call at a time, socket and shared memory alternating (outputs read back)."""
    from mhaserve.client import Client

    print("\nmhaserve's Python client, c=1, output and attn_weights, socket and shared memory alternating:")
    with Client(url) as client, client.shared_memory() as regions:
        for length in lengths:
            query = np.random.default_rng(length).standard_normal((1, length, D), dtype=np.float32)
            took: dict[str, list[float]] = {"socket": [], "shm": []}
            with bench_lock():
                for call in range(calls + 3):  # three warm-up pairs
                    for mode in ("socket", "shm"):
                        started = time.perf_counter()
                        client.infer(query, shared_memory=regions if mode == "shm" else None)
                        if call >= 3:
                            took[mode].append((time.perf_counter() - started) * 1000)
            socket, shm = np.median(took["socket"]), np.median(took["shm"])
            print(f"  [1,{length},{D}]: p50 socket {socket:.1f} ms, shm {shm:.1f} ms, shm/socket {shm / socket:.2f}")


RESTRICTED = 'restricted = ["shared-memory", "model-repository", "trace", "logging"]'


def peers_with_shared_memory_open(folder: Path) -> Path:
    """A copy of the peers' scripts whose PyTriton leaves the shared-memory endpoints open: PyTriton 0.7 puts
    them behind a random access token (as the peers' serve_pytriton.py asks), which perf_analyzer cannot send."""
    copy = folder / "peers"
    shutil.copytree(PEERS, copy, ignore=shutil.ignore_patterns(".peers", "results-*"))
    script = copy / "serve_pytriton.py"
    text = script.read_text()
    if RESTRICTED not in text:
        raise SystemExit(f"{script}: its restricted endpoints changed; update RESTRICTED here")
    script.write_text(text.replace(RESTRICTED, RESTRICTED.replace('"shared-memory", ', "")))
    return copy


def start_triton(scripts: Path, peers_dir: Path) -> None:
    environment = {**os.environ, "PEERS_DIR": str(peers_dir)}
    command = [str(scripts / "start_peer.sh"), "pytriton-shm", "127.0.0.1:8001", "serve_pytriton.sh"]
    done = subprocess.run(command, capture_output=True, text=True, env=environment)
    if done.returncode != 0:
        raise SystemExit(f"Triton did not start: {done.stdout[-2000:]}{done.stderr[-2000:]}")


def stop_triton(scripts: Path, peers_dir: Path) -> None:
    environment = {**os.environ, "PEERS_DIR": str(peers_dir)}
    subprocess.run([str(scripts / "stop_peer.sh"), "pytriton-shm"], env=environment, capture_output=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-dir", type=Path, default=None, help="the peers' PEERS_DIR (omit: mhaserve only)")
    parser.add_argument("--servers", default="mhaserve,triton", help="which to measure (triton needs --peers-dir)")
    parser.add_argument("--lengths", default="128,512")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--seconds", type=float, default=4.0, help="perf_analyzer's measurement window")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every point, alternating; medians")
    parser.add_argument("--calls", type=int, default=15, help="the Python client's timed calls per mode and shape")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    concurrencies = [int(x) for x in args.concurrency.split(",")]
    results: dict[tuple, list[dict]] = {}
    folder = Path(tempfile.mkdtemp(prefix="bench-shm-"))

    def measure(server: str, url: str, names: tuple[str, ...], batched: bool) -> None:
        for length in lengths:
            data = input_data(folder, length, names, batched)
            for concurrency in concurrencies:
                for _ in range(args.rounds):
                    for shared in ("none", "system"):
                        before = server_phases(url) if server == "mhaserve" else None
                        point = perf_analyzer(url, data, length, concurrency, shared, batched, args.seconds)
                        if before is not None and "p50_ms" in point:
                            after = server_phases(url)
                            count, success_ns, infer_ns = (a - b for a, b in zip(after, before, strict=True))
                            point["server_ms"] = success_ns / max(count, 1) / 1e6
                            point["run_ms"] = infer_ns / max(count, 1) / 1e6
                        print(f"{server} L={length} c={concurrency} shm={shared}: {point}", file=sys.stderr, flush=True)
                        results.setdefault((server, length, concurrency, shared), []).append(point)

    server_args = ("--allow-client-shm", "true", "--max-inflight-bytes", str(4 << 30), "--metrics-port", "-1")
    servers = [name for name in args.servers.split(",") if name != "triton" or args.peers_dir is not None]
    if "mhaserve" in servers:
        with ServerProcess(None, *server_args) as server:
            measure("mhaserve", server.url, ("query", "key", "value", "mask"), batched=False)
            python_client(server.url, lengths, args.calls)
    if "triton" in servers:
        scripts = peers_with_shared_memory_open(folder)
        start_triton(scripts, args.peers_dir)
        try:
            measure("triton", "127.0.0.1:8001", ("x",), batched=True)
        finally:
            stop_triton(scripts, args.peers_dir)

    def median(key, field):
        values = [p[field] for p in results.get(key, []) if field in p]
        return float(np.median(values)) if values else float("nan")

    print("| server | shape | c | socket p50 ms | shm p50 ms | shm/socket p50 | socket infer/s | shm infer/s |")
    print("|---|---|---|---|---|---|---|---|")
    for server in servers:
        for length in lengths:
            for c in concurrencies:
                socket_p50, shm_p50 = (
                    median((server, length, c, "none"), "p50_ms"),
                    median((server, length, c, "system"), "p50_ms"),
                )
                print(
                    f"| {server} | [1,{length},{D}] | {c} | {socket_p50:.2f} | {shm_p50:.2f} | "
                    f"{shm_p50 / socket_p50:.2f} | "
                    f"{median((server, length, c, 'none'), 'infer_per_s'):.0f} | "
                    f"{median((server, length, c, 'system'), 'infer_per_s'):.0f} |"
                )
    if "mhaserve" in servers and 1 in concurrencies:
        print("\nWhere mhaserve's time goes at c=1 (ms; the server's means from its statistics, perf_analyzer's p50):")
        print("| shape | path | p50 | in the server | of which the run | the rest of the server | outside the server |")
        print("|---|---|--:|--:|--:|--:|--:|")
        for length in lengths:
            for shared in ("none", "system"):
                key = ("mhaserve", length, 1, shared)
                p50, server, run = (median(key, field) for field in ("p50_ms", "server_ms", "run_ms"))
                print(f"| [1,{length},{D}] | {'shared memory' if shared == 'system' else 'socket'} | {p50:.2f} | "
                      f"{server:.2f} | {run:.2f} | {server - run:.2f} | {p50 - server:.2f} |")  # fmt: skip
            floor = onnx_runtime_floor(length)
            socket = median(("mhaserve", length, 1, "none"), "p50_ms")
            print(f"| [1,{length},{D}] | ONNX Runtime alone, in process | {floor:.2f} | | | | |")
            print(f"\n  [1,{length},{D}]: the floor is {floor / socket:.2f} of the socket's p50")
    if servers == ["mhaserve", "triton"]:
        print("\nmhaserve shared memory p50 over Triton's shared memory p50:")
        for length in lengths:
            for c in concurrencies:
                ours, theirs = (
                    median(("mhaserve", length, c, "system"), "p50_ms"),
                    median(("triton", length, c, "system"), "p50_ms"),
                )
                print(f"  [1,{length},{D}] c={c}: {ours / theirs:.2f}")


if __name__ == "__main__":
    main()
