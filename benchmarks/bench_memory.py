"""What a request really costs the server's memory, per shape, against what the in-flight budget reserves
for it; and a flood, with the memory held once it is over.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_memory.py

One server process on the default 512/8 model (limits raised so [32,512,512] is valid, the budget raised so
it is never refused during the per-shape part). For each shape, alone on an idle server: the server's peak
RSS is reset (/proc/PID/clear_refs), one request is sent over gRPC (the project's client, in this process),
and the peak over the RSS before it is read (VmHWM), beside what the budget counts for it (server/memory.py) and their
ratio (the budget holds when the ratio is at most 1). Then, on a second server at the default budget
(1 GiB): a flood of --flood requests of [8,256,512] with weights from --concurrency callers, RSS sampled
every 20 ms, and the RSS --idle-s seconds after the last answer, against the RSS before the flood.
Not a test: it prints numbers; BENCHMARKS.md records them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mhaserve.client.grpc import Client, build_infer_request
from mhaserve.client.http import HttpClient
from mhaserve.contract.signature import ModelSignature
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.checked_load import peak_rss_mib, reset_peak_rss, rss_mib
from mhaserve.server.grpc.protobuf import decode_infer_request
from mhaserve.server.memory import answer_bytes, input_bytes, request_workspace_bytes
from mhaserve.server.process import ServerProcess
from mhaserve.server.tensors import Limits

D, H = 512, 8
MIB = 1 << 20
# (batch, q_len, kv_len, mask form, attention weights returned)
SHAPES = [
    (1, 16, 16, None, True),
    (1, 128, 128, None, True),
    (1, 512, 512, None, True),
    (8, 256, 256, None, True),
    (8, 256, 256, None, False),
    (4, 512, 512, "padding", True),
    (4, 512, 512, "full", True),
    (8, 128, 512, None, True),
    (32, 512, 512, None, True),
    (32, 512, 512, None, False),
    (32, 512, 512, "full", True),
]


def arrays(batch, q_len, kv_len, mask_form, seed=0):
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((batch, q_len, D), dtype=np.float32)
    key = value = None if kv_len == q_len else rng.standard_normal((batch, kv_len, D), dtype=np.float32)
    mask = None
    if mask_form == "padding":
        mask = rng.random((batch, kv_len)) < 0.8
    elif mask_form == "full":
        mask = rng.random((batch, q_len, kv_len)) < 0.8
    return query, key, value, mask


def per_shape(model_dir) -> None:
    args = (
        "--max-batch-size",
        "64",
        "--max-q-len",
        "512",
        "--max-kv-len",
        "512",
        "--max-inflight-bytes",
        str(16 << 30),
    )
    print("shape (B, Lq, Lk, mask, weights) | peak over idle MiB | budget reserves MiB | peak / reserved")
    for batch, q_len, kv_len, mask_form, weights in SHAPES:
        query, key, value, mask = arrays(batch, q_len, kv_len, mask_form)
        # A fresh server for each shape: what one request costs the first time, not what is left over.
        with ServerProcess(model_dir, *args) as server, Client(server.url) as client:
            pid = server.proc.pid
            time.sleep(0.5)
            before = rss_mib(pid)
            reset_peak_rss(pid)
            client.infer(query, key, value, mask, attn_weights=weights, timeout=120)
            peak = peak_rss_mib(pid) - before
        decoded = decode_infer_request(
            build_infer_request("mha", query, key, value, mask, weights),
            ModelSignature("mha", "1", D, H),
            Limits(64, 512, 512),
        )
        reserved = input_bytes(decoded) + answer_bytes(decoded, H) + request_workspace_bytes(decoded, H)
        scores = 4 * batch * H * q_len * kv_len
        label = f"({batch}, {q_len}, {kv_len}, {mask_form or '-'}, {'yes' if weights else 'no'})"
        reserved, scores = reserved / MIB, scores / MIB
        print(f"{label:<36} {peak:8.1f} {reserved:8.1f} {peak / reserved:6.2f}   "
              f"(scores {scores:.1f} MiB, peak/scores {peak / scores:.2f})", flush=True)  # fmt: skip


def flood(model_dir, count: int, concurrency: int, idle_s: float, protocol: str = "grpc") -> None:
    with ServerProcess(model_dir, "--max-q-len", "512", "--max-kv-len", "512") as server:
        pid = server.proc.pid
        query = np.random.default_rng(1).standard_normal((8, 256, D), dtype=np.float32)
        with Client(server.url) as client:
            client.infer(query[:1], timeout=60)
        time.sleep(1)
        before = rss_mib(pid)
        peak, done = before, threading.Event()

        def sample():
            nonlocal peak
            while not done.is_set():
                peak = max(peak, rss_mib(pid))
                time.sleep(0.02)

        outcomes = {"ok": 0, "refused": 0}

        def connect():
            if protocol == "http":
                return contextlib.nullcontext(HttpClient(server.http_url.removeprefix("http://")))
            return Client(server.url)

        def caller(n: int):
            with connect() as client:
                for _ in range(n):
                    try:
                        client.infer(query, attn_weights=True, timeout=120)
                        outcomes["ok"] += 1
                    except Exception:
                        outcomes["refused"] += 1

        sampler = threading.Thread(target=sample)
        sampler.start()
        started = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(caller, [count // concurrency] * concurrency))
        seconds = time.perf_counter() - started
        done.set()
        sampler.join()
        time.sleep(idle_s)
        idle = rss_mib(pid)
        print(
            f"flood of {count} x [8,256,512] with weights over {protocol}, c={concurrency}: {outcomes['ok']} OK, "
            f"{outcomes['refused']} refused, {seconds:.1f} s; RSS before {before:.0f} MiB, "
            f"peak {peak:.0f} MiB, {idle_s:g} s after {idle:.0f} MiB",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--idle-s", type=float, default=5.0)
    parser.add_argument("--skip-shapes", action="store_true")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc", help="of the flood")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    if not args.skip_shapes:
        per_shape(model_dir)
    if args.flood:
        flood(model_dir, args.flood, args.concurrency, args.idle_s, args.protocol)
    return 0


if __name__ == "__main__":
    sys.exit(main())
