"""Model repository: time to load a version, RSS per loaded version, and latency before, during and after a swap.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_repository.py [--rate 100] [--phase-seconds 5]

1. A server in explicit mode on a repository of a 512/8 and a 768/12 model loads and unloads each --cycles
   times through RepositoryModelLoad/Unload: the load call's time (session, warm-up and the batching cost
   model), and the server's RSS before, with the version loaded, and after its unload.
2. A server serving version 1 of the 512/8 model gets an open-loop load of [1,16,512] requests (with
   attention weights) at --rate per second from this process; version 2 is added and loaded (the swap),
   and p50/p99 are taken by send time before, during (the load call) and after it. Errors are counted.
Not a test: it prints numbers; BENCHMARKS.md records them.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from mhaserve.client.grpc import AsyncClient
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.checked_load import rss_mib
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.server.process import ServerProcess

CACHE = Path.home() / ".cache" / "mhaserve" / "bench-repository"


def exported(name: str, d_model: int, heads: int, seed: int) -> Path:
    folder = CACHE / name
    if not (folder / "manifest.json").exists():
        command = [sys.executable, "-m", "mhaserve.cli", "export", "--out", str(folder), "--d-model", str(d_model),
                   "--heads", str(heads), "--seed", str(seed), "--validation-seed", "0"]  # fmt: skip
        subprocess.run(command, check=True, capture_output=True)
    return folder


def control(server: ServerProcess, call: str, name: str) -> float:
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        started = time.perf_counter()
        if call == "load":
            stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name=name), timeout=300)
        else:
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name=name), timeout=300)
        return time.perf_counter() - started


def settle(server: ServerProcess) -> float:
    time.sleep(1.0)  # the trim after an unload runs on the loader thread
    return rss_mib(server.proc.pid)


def load_times_and_memory(models: dict[str, Path], cycles: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp)
        for name, folder in models.items():
            shutil.copytree(folder, repository / name / "1")
        with ServerProcess(None, "--model-repository", str(repository), "--model-control-mode", "explicit") as server:
            print(f"server with nothing loaded: RSS {settle(server):.0f} MiB")
            for name in models:
                loads, loaded, unloaded = [], [], []
                for _ in range(cycles):
                    before = settle(server)
                    loads.append(control(server, "load", name))
                    loaded.append(settle(server) - before)
                    control(server, "unload", name)
                    unloaded.append(settle(server) - before)
                print(
                    f"{name}: load {statistics.median(loads):.2f} s (runs {', '.join(f'{t:.2f}' for t in loads)});\n  "
                    f"RSS +{statistics.median(loaded):.0f} MiB loaded (runs {', '.join(f'{m:+.0f}' for m in loaded)}), "
                    f"{', '.join(f'{m:+.0f}' for m in unloaded)} MiB after each unload;\n  "
                    f"RSS at the end {rss_mib(server.proc.pid):.0f} MiB"
                )


async def open_loop(url: str, rate: float, stop: asyncio.Event, records: list) -> None:
    query = np.random.default_rng(0).standard_normal((1, 16, 512), dtype=np.float32)
    async with AsyncClient(url) as client:

        async def one() -> None:
            sent = time.perf_counter()
            try:
                result = await client.infer(query, timeout=30)
                records.append((sent, time.perf_counter() - sent, "OK", result.model_version))
            except grpc.RpcError as error:
                records.append((sent, time.perf_counter() - sent, error.code().name, ""))

        tasks = set()
        next_at = time.perf_counter()
        while not stop.is_set():
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += 1 / rate
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        await asyncio.gather(*tasks)


def phase_line(name: str, records: list) -> str:
    latencies = np.array([latency for _, latency, status, _ in records if status == "OK"]) * 1000
    errors = sum(1 for *_, status, _ in records if status != "OK")
    versions = sorted({version for *_, version in records if version})
    if not len(latencies):
        return f"{name}: no answers, {errors} errors"
    return (
        f"{name:>7}: {len(records)} requests, p50 {np.percentile(latencies, 50):.2f} ms, "
        f"p99 {np.percentile(latencies, 99):.2f} ms, errors {errors}, answered by version(s) {', '.join(versions)}"
    )


def swap_under_load(v1: Path, v2: Path, rate: float, phase_s: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        repository = Path(tmp)
        shutil.copytree(v1, repository / "mha" / "1")
        args = ("--model-repository", str(repository), "--model-control-mode", "explicit", "--load-model", "mha")
        with ServerProcess(None, *args) as server:
            records: list = []

            async def run() -> tuple[float, float, float]:
                stop = asyncio.Event()
                load = asyncio.create_task(open_loop(server.url, rate, stop, records))
                await asyncio.sleep(phase_s + 1.0)  # the first second is warm-up
                shutil.copytree(v2, repository / "mha" / "2")
                swap_started = time.perf_counter()
                await asyncio.to_thread(control, server, "load", "mha")
                swap_ended = time.perf_counter()
                rss_after_swap = rss_mib(server.proc.pid)
                await asyncio.sleep(phase_s)
                stop.set()
                await load
                return swap_started, swap_ended, rss_after_swap

            rss_before = rss_mib(server.proc.pid)
            swap_started, swap_ended, rss_after_swap = asyncio.run(run())
            start = records[0][0] + 1.0
            print(f"swap under {rate:.0f} requests/s of [1,16,512] with weights; the swap (load call) took "
                  f"{swap_ended - swap_started:.2f} s")  # fmt: skip
            print(phase_line("before", [r for r in records if start <= r[0] < swap_started]))
            print(phase_line("during", [r for r in records if swap_started <= r[0] < swap_ended]))
            print(phase_line("after", [r for r in records if r[0] >= swap_ended]))
            print(f"server RSS before the swap {rss_before:.0f} MiB, just after it {rss_after_swap:.0f} MiB, "
                  f"at the end {settle(server):.0f} MiB")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second during the swap")
    parser.add_argument("--phase-seconds", type=float, default=5.0)
    parser.add_argument("--cycles", type=int, default=3, help="load/unload cycles per model")
    args = parser.parse_args()
    models = {"mha512": ensure_default_model(), "mha768": exported("mha768-seed0", 768, 12, 0)}
    load_times_and_memory(models, args.cycles)
    swap_under_load(models["mha512"], exported("mha512-seed1", 512, 8, 1), args.rate, args.phase_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
