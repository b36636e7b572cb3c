"""gRPC receipt across connections: N clients, each on its own connection, send one large ModelInfer at once to a
server of the embedded default model (512/8) with `--max-inflight-bytes 268435456` (256 MiB); every message is
refused (its query is past --max-q-len), after grpcio has received it whole. Printed per point: the server's idle
RSS, its peak over idle (VmHWM), RSS 3 s after, seconds, the answers.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_receipt_connections.py [--mib 96] [--connections 8,32]
        [-- SERVER FLAGS...]

Not a test: BENCHMARKS.md ("Memory while requests are received") records the figures with this command.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time

import grpc
import numpy as np

from mhaserve.client.grpc import build_infer_request
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.checked_load import peak_rss_mib, reset_peak_rss, rss_mib
from mhaserve.testing.server_process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=96, help="each message's size")
    parser.add_argument("--connections", default="8,32")
    parser.add_argument("server_flags", nargs="*")
    args = parser.parse_args()
    query = np.ones((1, args.mib * (1 << 20) // (4 * 512), 512), np.float32)
    raw = build_infer_request("mha", query).SerializeToString()
    flags = ("--max-inflight-bytes", str(256 << 20), "--warmup-runs", "0", *args.server_flags)
    with ServerProcess(ensure_default_model(), *flags) as server:
        pid = server.proc.pid
        for n in (int(c) for c in args.connections.split(",")):
            time.sleep(2)
            idle = rss_mib(pid)
            reset_peak_rss(pid)
            answers = collections.Counter()

            def send(answers=answers) -> None:
                # A subchannel pool of its own: a connection of its own, as a client on another host has.
                options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)]
                with grpc.insecure_channel(server.url, options=options) as channel:
                    call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
                    try:
                        call(raw, timeout=120)
                        answers["OK"] += 1
                    except grpc.RpcError as error:
                        answers[error.code().name] += 1

            clients = [threading.Thread(target=send) for _ in range(n)]
            started = time.perf_counter()
            for client in clients:
                client.start()
            for client in clients:
                client.join()
            took = time.perf_counter() - started
            time.sleep(3)
            print(
                f"{' '.join(args.server_flags) or 'defaults'} | {n} connections x {len(raw) >> 20} MiB | idle "
                f"{idle:.0f} MiB | peak +{peak_rss_mib(pid) - idle:.0f} MiB | 3 s after +{rss_mib(pid) - idle:.0f} MiB "
                f"| {took:.1f} s | {dict(answers)}",
                flush=True,
            )


if __name__ == "__main__":
    main()
