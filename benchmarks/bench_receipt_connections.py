"""gRPC receipt across connections: N clients, each on its own connection, send one large ModelInfer (or, with
--rpc stream, one request on a ModelStreamInfer stream) at once to a server of the embedded default model (512/8)
with `--max-inflight-bytes 268435456` (256 MiB); every message is refused (its query is past --max-q-len), after
grpcio has received it whole. Each point is repeated --rounds times on the same server. Printed per round: the
server's idle RSS, its peak over idle (VmHWM), RSS 5 s after, seconds, the answers. With --baseline REV, the same
on that revision's code first (bench_revisions.baseline_checkout).

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_receipt_connections.py [--mib 96] [--connections 8,32]
        [--rpc unary|stream] [--rounds 1] [--baseline REV] [-- SERVER FLAGS...]

Not a test: BENCHMARKS.md ("Hostile clients") records the figures with this command.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time

import grpc
import numpy as np
from bench_revisions import baseline_checkout

from mhaserve.client.grpc import build_infer_request
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.checked_load import peak_rss_mib, reset_peak_rss, rss_mib
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.server.process import ServerProcess


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=96, help="each message's size")
    parser.add_argument("--connections", default="8,32")
    parser.add_argument("--rpc", choices=("unary", "stream"), default="unary")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--baseline", help="a revision to measure first, the same way")
    parser.add_argument("server_flags", nargs="*")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    if args.baseline:
        with baseline_checkout(args.baseline) as (env, _):
            measure("baseline", model_dir, args, env)
    measure("current", model_dir, args, None)


def measure(name: str, model_dir, args, env) -> None:
    query = np.ones((1, args.mib * (1 << 20) // (4 * 512), 512), np.float32)
    raw = build_infer_request("mha", query).SerializeToString()
    flags = ("--max-inflight-bytes", str(256 << 20), "--warmup-runs", "0", *args.server_flags)
    with ServerProcess(model_dir, *flags, env=env) as server:
        pid = server.proc.pid
        for n in (int(c) for c in args.connections.split(",")):
            for round_number in range(1, args.rounds + 1):
                time.sleep(2)
                idle = rss_mib(pid)
                reset_peak_rss(pid)
                answers = collections.Counter()
                clients = [threading.Thread(target=send, args=(server.url, raw, args.rpc, answers)) for _ in range(n)]
                started = time.perf_counter()
                for client in clients:
                    client.start()
                for client in clients:
                    client.join()
                took = time.perf_counter() - started
                time.sleep(5)
                print(
                    f"{name} {args.rpc} {' '.join(args.server_flags) or 'defaults'} | {n} connections x "
                    f"{len(raw) >> 20} MiB, round {round_number} | idle {idle:.0f} MiB | peak "
                    f"+{peak_rss_mib(pid) - idle:.0f} MiB | 5 s after +{rss_mib(pid) - idle:.0f} MiB | {took:.1f} s | "
                    f"{dict(answers)}",
                    flush=True,
                )


def send(url: str, raw: bytes, rpc: str, answers: collections.Counter) -> None:
    # A subchannel pool of its own: a connection of its own, as a client on another host has.
    options = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(url, options=options) as channel:
        try:
            if rpc == "unary":
                channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")(raw, timeout=120)
                answers["OK"] += 1
                return
            stream = channel.stream_stream(
                "/inference.GRPCInferenceService/ModelStreamInfer",
                response_deserializer=pb.ModelStreamInferResponse.FromString,
            )
            for answer in stream(iter([raw]), timeout=120):
                answers[answer.error_message.split(":")[0] or "OK"] += 1
        except grpc.RpcError as error:
            answers[error.code().name] += 1


if __name__ == "__main__":
    main()
