"""The native server against the same model behind Ray Serve's gRPC proxy: one run, side by side.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_ray.py [--seconds 5] [--rounds 2] [--native-replica]

Each round measures, one after the other with nothing else up: the native server (`mhaserve serve`, one
inference worker, ONNX Runtime on both cores); a Ray cluster of a head and two worker nodes of one CPU each,
one replica per worker (ONNX Runtime on one core each); and a head with one worker node of two CPUs holding
both replicas. The load is `mhaserve bench`'s (LoadGenerator, closed loop, the same client processes for
every system) at [1,16,512] and [1,128,512] with attention weights, concurrency 1 and 16. Rounds alternate
the order; the median round is printed.

Where a call's time goes: one replica on one worker node, 300 calls one after another at [1,16,512] from
this process, against the native server the same way: the client's median beside the server's own time per
request (ModelStatistics success: decode, queue, compute, encode), the difference being the transport (for
Ray: the proxy, its routing and the hop to the replica's actor).

--batching instead compares batching inside one replica (two CPUs, one worker node), at [1,16,512] and at
lengths 16..128, concurrency 16: the project's batcher in the replica's data plane (what ships) against
Ray's @serve.batch gathering ModelInfer calls (a variant defined here: the data plane's batching off, each
gathered list merged, run and split with the batcher's own merge and split).

--native-replica instead compares, with everything up throughout and the targets taken in turn each round: the
native server; one replica (a one-node cluster of two CPUs, the replica reserving both) deployed with a replica
port, called at its own native server; and the same replica through Ray's gRPC proxy. The load as above, at
[1,16,512] and [1,128,512], concurrency 1 and 16.

On two cores, two worker nodes share the same two cores as one: this shows the cost of the cluster's
processes and hops, not the gain of a second machine. Not a test: BENCHMARKS.md records the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import numpy as np

from mhaserve.client.grpc import Client
from mhaserve.export.default_model import ensure_default_model
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload
from mhaserve.server.process import ServerProcess, free_port

SHAPES = (16, 128)
CONCURRENCY = (1, 16)
APP = "mha"


@contextlib.contextmanager
def native(model_dir):
    with ServerProcess(model_dir, "--warmup-runs", "2") as server:
        yield server.url, ""


@contextlib.contextmanager
def ray_cluster(model_dir, workers: int, replicas: int = 2, replica_cpus: float = 1, batching: str = "ours"):
    """A head (no CPUs: Serve's controller and the one proxy) and ``workers`` worker nodes sharing two CPUs,
    the model deployed as ``replicas`` replicas; ``batching``: ours (the data plane's batcher) | ray
    (@serve.batch)."""
    import ray
    from ray.cluster_utils import Cluster

    from mhaserve.server.ray.deployment import OipReplica, deploy

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        for _ in range(workers):
            cluster.add_node(num_cpus=2 // workers)
        cluster.wait_for_nodes()
        port = free_port()
        started = time.monotonic()
        deploy(model_dir, address=cluster.address, name=APP, grpc_port=port, http_port=free_port(),
               proxy_location="HeadOnly", min_replicas=replicas, max_replicas=replicas, replica_cpus=replica_cpus,
               settings={"dynamic_batching": batching == "ours"},
               replica_class=OipReplica if batching == "ours" else ray_batched_replica_class())  # fmt: skip
        print(f"  ray ({workers} worker nodes): deployed in {time.monotonic() - started:.1f} s", file=sys.stderr)
        yield f"127.0.0.1:{port}", APP
    finally:
        ray.shutdown()
        cluster.shutdown()


def ray_batched_replica_class():
    """OipReplica with Ray's @serve.batch in place of the data plane's batcher (benchmark only: no checks
    beyond the codec's, no statistics)."""
    import asyncio

    from ray import serve

    from mhaserve.server.batcher import merge, split
    from mhaserve.server.grpc.protobuf import decode_grpc_request, encode_grpc_response
    from mhaserve.server.inference import InferenceResponse, run_inputs_of
    from mhaserve.server.ray.deployment import OipReplica, _Serialized

    class RayBatchedReplica(OipReplica):
        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.0)
        async def _infer_batch(self, requests):
            served = self.dataplane.resolve(APP, "")
            requests = [decode_grpc_request(r) for r in requests]
            decoded = [run_inputs_of(r, served.signature, self.dataplane.limits) for r in requests]
            merged = merge(decoded)
            arrays = await asyncio.get_running_loop().run_in_executor(
                None, served.session.run, merged.outputs, merged.query, merged.key, merged.value, merged.mask
            )
            answers, _ = split(merged, dict(zip(merged.outputs, arrays, strict=True)), decoded)
            return [
                _Serialized(encode_grpc_response(InferenceResponse(served.signature, r, {n: a[n] for n in d.outputs})))
                for r, d, a in zip(requests, decoded, answers, strict=True)
            ]

        async def ModelInfer(self, request, grpc_context):  # noqa: N802
            return await self._infer_batch(request)

    return RayBatchedReplica


def compare_native_replica(model_dir, seconds: float, rounds: int) -> None:
    import ray
    from ray.cluster_utils import Cluster

    from mhaserve.server.ray.deployment import deploy, native_addresses

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        proxy_port = free_port()
        deploy(model_dir, address=cluster.address, name=APP, grpc_port=proxy_port, http_port=free_port(),
               min_replicas=1, max_replicas=1, replica_cpus=2, native_port=0)  # fmt: skip
        (replica,) = native_addresses(APP)
        with ServerProcess(model_dir, "--warmup-runs", "2") as server:
            targets = {"native server": (server.url, ""), "replica, natively": (replica, ""),
                       "replica, through the proxy": (f"127.0.0.1:{proxy_port}", APP)}  # fmt: skip
            found = {(name, key): [] for name in targets for key in ((16, 1), (16, 16), (128, 1), (128, 16))}
            for r in range(rounds):
                for name in list(targets) if r % 2 == 0 else list(reversed(targets)):
                    url, application = targets[name]
                    with LoadGenerator(url, processes=2) as generator:
                        for length, concurrency in ((16, 1), (16, 16), (128, 1), (128, 16)):
                            result = generator.measure(Workload(512, 1, length, length, application=application),
                                                       Point("closed", concurrency, seconds, 1.5))  # fmt: skip
                            found[(name, (length, concurrency))].append(result.throughput)
                            print(f"round {r + 1} {name} [1,{length},512] c{concurrency}: {result.throughput:.0f}/s "
                                  f"errors {result.errors}", file=sys.stderr)  # fmt: skip
    finally:
        ray.shutdown()
        cluster.shutdown()
    print("| point | target | req/s, rounds | req/s / native, median |")
    print("|---|---|---|--:|")
    for length, concurrency in ((16, 1), (16, 16), (128, 1), (128, 16)):
        native_rate = statistics.median(found[("native server", (length, concurrency))])
        for name in targets:
            rates = found[(name, (length, concurrency))]
            print(f"| [1,{length},512] c{concurrency} | {name} | {' / '.join(f'{r:.0f}' for r in rates)} | "
                  f"{statistics.median(rates) / native_rate:.2f} |")  # fmt: skip


def compare_batching(model_dir, seconds: float, rounds: int) -> None:
    workloads = {"[1,16,512]": (16, 16), "[1,16..128,512]": (16, 128)}
    found = {(batching, shape): [] for batching in ("ours", "ray") for shape in workloads}
    for r in range(rounds):
        for batching in ("ours", "ray") if r % 2 == 0 else ("ray", "ours"):
            with (
                ray_cluster(model_dir, 1, replicas=1, replica_cpus=2, batching=batching) as (url, application),
                LoadGenerator(url, 2) as generator,
            ):
                for shape, (low, high) in workloads.items():
                    result = generator.measure(
                        Workload(512, 1, low, high, application=application), Point("closed", 16, seconds, 1.5)
                    )
                    found[(batching, shape)].append(
                        (result.throughput, result.latency_ms["p50"], result.latency_ms["p99"])
                    )
                    print(
                        f"round {r + 1} {batching} {shape}: {result.throughput:.0f}/s errors {result.errors}",
                        file=sys.stderr,
                    )
    print("| c16 | batching | req/s | p50 ms | p99 ms | req/s / ours |")
    print("|---|---|--:|--:|--:|--:|")
    for shape in workloads:
        ours = statistics.median(t for t, _, _ in found[("ours", shape)])
        for batching, label in (("ours", "the project's batcher"), ("ray", "Ray's @serve.batch")):
            rows = found[(batching, shape)]
            rate, p50, p99 = (statistics.median(row[i] for row in rows) for i in range(3))
            print(f"| {shape} | {label} | {rate:.0f} | {p50:.1f} | {p99:.1f} | {rate / ours:.2f} |")


def breakdown(system, model_dir, calls: int = 300) -> tuple[float, float]:
    """(client p50 ms, server ms per request) over ``calls`` sequential [1,16,512] calls to one server."""
    query = np.random.default_rng(0).standard_normal((1, 16, 512), dtype=np.float32)
    with system(model_dir) as (url, application), Client(url, application=application or None) as client:
        for _ in range(50):
            client.infer(query, timeout=60)
        before = client.statistics(timeout=10).inference_stats.success
        latencies = []
        for _ in range(calls):
            started = time.perf_counter()
            client.infer(query, timeout=60)
            latencies.append(time.perf_counter() - started)
        after = client.statistics(timeout=10).inference_stats.success
    return 1e3 * statistics.median(latencies), (after.ns - before.ns) / (after.count - before.count) / 1e6


def measure(system, model_dir, seconds: float) -> dict:
    results = {}
    with system(model_dir) as (url, application):
        with LoadGenerator(url, processes=2) as generator:
            for length in SHAPES:
                workload = Workload(512, 1, length, length, application=application)
                for concurrency in CONCURRENCY:
                    point = Point("closed", concurrency, seconds, 1.5)
                    result = generator.measure(workload, point)
                    results[(length, concurrency)] = (result.throughput, result.latency_ms["p50"])
                    print(f"    [1,{length},512] c{concurrency}: {result.throughput:.0f}/s p50 "
                          f"{result.latency_ms['p50']:.2f} ms errors {result.errors}", file=sys.stderr)  # fmt: skip
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batching", action="store_true", help="compare batching inside a replica instead")
    parser.add_argument("--native-replica", action="store_true", help="compare a replica serving natively instead")
    args = parser.parse_args()
    model_dir = ensure_default_model()
    if args.native_replica:
        compare_native_replica(model_dir, args.seconds, args.rounds)
        return 0
    if args.batching:
        compare_batching(model_dir, args.seconds, args.rounds)
        return 0
    systems = {
        "native": native,
        "ray, 2 worker nodes": lambda d: ray_cluster(d, 2),
        "ray, 1 worker node": lambda d: ray_cluster(d, 1),
    }
    rounds = {name: [] for name in systems}
    for r in range(args.rounds):
        order = list(systems) if r % 2 == 0 else list(reversed(systems))
        for name in order:
            print(f"round {r + 1}: {name}", file=sys.stderr)
            rounds[name].append(measure(systems[name], model_dir, args.seconds))
    print("| shape | c | system | req/s | p50 ms | req/s / native | p50 / native |")
    print("|---|--:|---|--:|--:|--:|--:|")
    for length in SHAPES:
        for concurrency in CONCURRENCY:
            key = (length, concurrency)
            native_rate, native_p50 = (statistics.median(r[key][i] for r in rounds["native"]) for i in range(2))
            for name in systems:
                throughput, p50 = (statistics.median(r[key][i] for r in rounds[name]) for i in range(2))
                print(f"| [1,{length},512] | {concurrency} | {name} | {throughput:.0f} | {p50:.2f} | "
                      f"{throughput / native_rate:.2f} | {p50 / native_p50:.2f} |")  # fmt: skip
    print()
    print("| one server, sequential [1,16,512] | client p50 ms | in the server ms | transport ms |")
    print("|---|--:|--:|--:|")
    for name, system in {"native": native, "ray, 1 replica": lambda d: ray_cluster(d, 1, replicas=1)}.items():
        client_ms, server_ms = breakdown(system, model_dir)
        print(f"| {name} | {client_ms:.2f} | {server_ms:.2f} | {client_ms - server_ms:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
