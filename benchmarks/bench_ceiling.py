"""What throughput two shared cores allow at concurrency 16: the model's work plus the transport's.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_ceiling.py [--model-dir DIR] [--seconds 6]

For each shape ([1,16,512] and [1,128,512], attention weights requested), in alternating rounds:
- ORT: in-process runs of 16 requests merged into one, as the batcher merges them (rows/s, 2 threads);
- echo: a bare grpc.aio server answering every call with the server's own response bytes, unparsed,
  called by 16 client threads in this process: request and answer bytes through gRPC and back,
  with nothing computed (calls/s);
- server: mhaserve serve, called by the same client threads.
Every variant has the machine to itself, client included. If each call costs the machine ORT's time
plus the echo's time, and nothing else, the most any server on this stack can answer is
1 / (1/ORT + 1/echo): the ceiling. Prints server/ORT (the concurrency-16 target's ratio) and server/ceiling. Not a test.
"""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import numpy as np
from bench_server import SHAPES, bytes_call, ort_session, record_answers, start_helper

from mhaserve.contract.model_dir import MODEL_FILE

CONCURRENCY = 16


def calls_per_second(call, request: bytes, seconds: float) -> float:
    """Closed loop of CONCURRENCY threads, each parsing its answers as a client would."""
    from mhaserve.client.grpc import parse_infer_response
    from mhaserve.protos.generated import grpc_service_pb2 as pb

    done, stop = [0] * CONCURRENCY, time.perf_counter() + seconds

    def worker(index: int) -> None:
        while time.perf_counter() < stop:
            parse_infer_response(pb.ModelInferResponse.FromString(call(request)))
            done[index] += 1

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(CONCURRENCY)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(done) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the embedded default model")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import onnxruntime as ort

    from mhaserve.export.default_model import ensure_default_model
    from mhaserve.server.process import ServerProcess

    model_dir = args.model_dir or ensure_default_model()
    session = ort_session(model_dir / MODEL_FILE, args.threads)
    server = ServerProcess(model_dir, "--intra-op-threads", str(args.threads)).start()
    infer = bytes_call(server.url)
    built, answers = record_answers(infer, SHAPES)
    requests = {shape: request.SerializeToString() for shape, (_, request) in built.items()}
    echo, echo_infer = start_helper("echo", answers, args.threads)

    print(f"onnxruntime {ort.__version__}, {args.threads} threads, {CONCURRENCY} client threads on the same cores")
    print(f"{'shape':<14} {'ORT rows/s':>10} {'echo /s':>8} {'ceiling /s':>10} {'server /s':>9} "
          f"{'server/ORT':>10} {'server/ceiling':>14}")  # fmt: skip
    try:
        for shape in SHAPES:
            merged = np.random.default_rng(1).standard_normal((CONCURRENCY, *shape[1:]), dtype=np.float32)
            mask = np.ones((1, 1, 1, shape[1]), dtype=bool)
            feeds = {"query": merged, "key": merged, "value": merged, "mask": mask}
            rates = {"ORT": [], "echo": [], "server": []}
            for _ in range(args.rounds):
                runs, stop = 0, time.perf_counter() + args.seconds
                started = time.perf_counter()
                while time.perf_counter() < stop:
                    session.run(None, feeds)
                    runs += 1
                rates["ORT"].append(runs * CONCURRENCY / (time.perf_counter() - started))
                rates["echo"].append(calls_per_second(echo_infer, requests[shape], args.seconds))
                rates["server"].append(calls_per_second(infer, requests[shape], args.seconds))
            o, e, s = (float(np.median(rates[name])) for name in ("ORT", "echo", "server"))
            ceiling = 1 / (1 / o + 1 / e)
            print(
                f"{str(list(shape)):<14} {o:10.0f} {e:8.0f} {ceiling:10.0f} {s:9.0f} {s / o:10.2f} {s / ceiling:14.2f}"
            )
    finally:
        echo.terminate()
        server.stop()


if __name__ == "__main__":
    main()
