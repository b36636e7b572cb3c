"""Ray Serve transport: the Open Inference Protocol's gRPC service on Ray's gRPC proxy, each replica a DataPlane
answering with the native server's gRPC codec (same checks, same statuses), its inference counted as protocol
"ray". Or, deployed with a replica port, each replica a native server (``mhaserve serve``, a process of its own on
that port of its node, no Ray in a request's path) that Ray places, scales, checks and restarts: the replica
forwards what Ray's proxy gives it to that server, and clients or a load balancer call the servers at the addresses
``native_addresses`` reads.

Ray's proxy hands a replica the parsed request and a RayServegRPCContext, and serialises what the replica
returns; a refusal is a status set on that context. Inference goes straight to the data plane with the gRPC
codec; the other RPCs are the native servicer's ``ProtocolRpcs``, so that nothing of the servicer is copied
here.

Needs the ``[ray]`` extra; the native server never imports this.
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from ray import serve

from mhaserve.contract.ring import sequence_header
from mhaserve.protos.generated import grpc_service_pb2 as pb

from ..config import ServerSettings
from ..cores import usable_cores
from ..dataplane import DataPlane
from ..errors import RequestError
from ..grpc.receipt import GRPC_STATUS
from ..grpc.servicer import ProtocolRpcs, infer_grpc, streamed_refusal
from .proxy import SERVICER_FUNCTION
from .router import HELD_SEQUENCES, ROUTER_PATH, ROUTING_STATS_PERIOD_S

log = logging.getLogger("mhaserve.server")

# Read by Serve's controller when it starts (ray.serve._private.constants), hence passed in its environment.
PROXY_READY_TIMEOUT = "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S"
SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
# The unary RPCs a replica answers with ProtocolRpcs (ModelInfer and ModelStreamInfer are defined on
# OipReplica). The repository extension is left out: a replica serves the one folder it was deployed with, and
# loading another is a redeploy.
UNARY_RPCS = (
    "ServerLive",
    "ServerReady",
    "ServerMetadata",
    "ModelReady",
    "ModelMetadata",
    "ModelConfig",
    "ModelStatistics",
)


class _Serialized:
    """An answer the codec already wrote as protobuf bytes; Ray's replica calls SerializeToString on it (and
    gRPC wants exactly bytes, no subclass)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name)
        return self.data


class OipReplica:
    """One Ray Serve replica: a DataPlane over the deployed model folder, answering the OIP's RPCs.

    ONNX Runtime runs as many threads as the CPUs the replica reserved (``ray_actor_options.num_cpus``)."""

    async def __init__(self, model_dir: str, settings: dict | None = None):
        # inference_nice 0: beside Ray's own busy processes, lowered inference threads starved (BENCHMARKS.md,
        # "Ray Serve"); the replica's event loop has Ray's proxy in front of it anyway.
        values = {"intra_op_threads": _reserved_cpus(), "inference_nice": 0, "http_port": -1, "metrics_port": -1}
        values.update(settings or {})
        self.dataplane = DataPlane(ServerSettings(**values), Path(model_dir))
        # A step of a sequence this replica does not hold was never started, or lived in a replica that exited or
        # now lives elsewhere on the router's ring (router.py): said so, the client may start it again.
        self.dataplane.sequences.lost_before("when a replica of this deployment exited or the replicas changed")
        await self.dataplane.start()
        self.answers = ProtocolRpcs(self.dataplane, frozenset(UNARY_RPCS))
        signature = next(iter(self.dataplane.served_models())).signature
        log.info("replica serving model=%s version=%s on node %s", signature.name, signature.version, _node_id())

    async def ModelInfer(self, request, grpc_context):  # noqa: N802 (the protocol's name)
        """Straight through the data plane with the gRPC codec; the proxy writes the answer."""
        try:
            async with self.dataplane.inference("ray") as call:
                return _Serialized(await infer_grpc(call, request))
        except RequestError as error:
            return _refused(grpc_context, error, pb.ModelInferResponse)

    async def ModelStreamInfer(self, requests, grpc_context):  # noqa: N802 (the protocol's name)
        """Answers in request order, a refusal as the answer's error_message (as the native server)."""
        async for request in requests:
            try:
                async with self.dataplane.inference("ray") as call:
                    answer = _Serialized(await infer_grpc(call, request, streamed=True))
            except RequestError as error:
                answer = streamed_refusal(error)
            yield answer

    async def _answer(self, method: str, request, grpc_context):
        try:
            return await getattr(self.answers, method)(request)
        except RequestError as error:
            return _refused(grpc_context, error, _response_type(method))

    def record_routing_stats(self) -> dict:
        """What Ray Serve's router reads of this replica (router.py): the sequences it holds, by the key clients
        route them by, so that their steps come here whatever replicas are added."""
        return {HELD_SEQUENCES: [sequence_header(sequence_id) for _, sequence_id in self.dataplane.sequences.live]}

    def check_health(self) -> None:
        """Ray's replica health check: a draining or unready data plane is restarted elsewhere."""
        if not self.dataplane.reports_ready:
            raise RuntimeError("the model is not ready")


def _unary(method: str):
    """The replica's RPC ``method``: its ``_answer`` (an OipReplica's data plane, a NativeReplica's server)."""

    async def rpc(self, request, grpc_context):
        return await self._answer(method, request, grpc_context)

    rpc.__name__ = rpc.__qualname__ = method
    return rpc


def _response_type(method: str):
    return getattr(pb, SERVICE.methods_by_name[method].output_type.name)


for _method in UNARY_RPCS:
    setattr(OipReplica, _method, _unary(_method))


def _refused(grpc_context, error: RequestError, response_type):
    """The refusal as the proxied call's status (the one place a replica maps the data plane's refusals)."""
    grpc_context.set_code(GRPC_STATUS[error.kind])
    grpc_context.set_details(error.message)
    return response_type()


class NativeReplica:
    """One Ray Serve replica serving natively: ``mhaserve serve`` on ``port`` of its node (0: a free port), its
    ONNX Runtime on the CPUs the replica reserved; Ray's proxied calls forwarded to it over loopback, so that one
    engine answers both. A process of its own: inside the replica's actor the native server shared the GIL with
    Ray's own threads (0.58x the native server at [1,16,512] with 16 callers, BENCHMARKS.md, "Ray Serve")."""

    async def __init__(self, model_dir: str, settings: dict | None = None, port: int = 0):
        import grpc

        from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

        from ..config import flag_of, setting_text
        from ..process import ServerProcess

        values = {"intra_op_threads": _reserved_cpus(), **(settings or {})}
        flags = [part for name, value in values.items() for part in (flag_of(name), setting_text(value))]
        self.server = ServerProcess(Path(model_dir), *flags, "--host", "0.0.0.0", "--http-port", "-1",
                                    "--metrics-port", "-1", port=port, end_with_parent=True)  # fmt: skip
        # Started from this loop's thread, which lives as long as the replica: a replica killed outright takes
        # its server with it (end_with_parent).
        self.server.start(wait=False)
        try:
            await asyncio.to_thread(self.server.wait_serving, 300)
        except RuntimeError:  # it exited (its log says why) or never said it serves: Ray tries another replica
            await asyncio.to_thread(self.server.stop)
            raise
        self._channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.server.port}", options=UNLIMITED_MESSAGES)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._address_key = _register_native_address(self.server.port)
        log.info("replica serving natively at port %d on node %s", self.server.port, _node_id())

    async def ModelStreamInfer(self, requests, grpc_context):  # noqa: N802 (the protocol's name)
        async for answer in self._stub.ModelStreamInfer(requests):
            yield answer

    async def _answer(self, method: str, request, grpc_context):
        """Forwarded to the server, its status passed on."""
        import grpc

        try:
            return await getattr(self._stub, method)(request)
        except grpc.aio.AioRpcError as error:
            grpc_context.set_code(error.code())
            grpc_context.set_details(error.details())
            return _response_type(method)()

    def check_health(self) -> None:
        """Ray's replica health check: a native server that exited is restarted elsewhere."""
        if not self.server.alive:
            raise RuntimeError(f"the native server exited: {self.server.stop_line}")

    async def __del__(self):
        """Ray's graceful stop of the replica: the native server drains (SIGTERM), as a stopped server does."""
        if getattr(self, "_address_key", None) is not None:  # not where its start failed
            _forget_native_address(self._address_key)
            await self._channel.close()
            await asyncio.to_thread(self.server.stop)


for _method in ("ModelInfer", *UNARY_RPCS):
    setattr(NativeReplica, _method, _unary(_method))

UNLIMITED_MESSAGES = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
# Where each replica serving natively answers, in the cluster's key-value store: "APP/REPLICA" -> "HOST:PORT".
NATIVE_ADDRESSES = "mhaserve-native-addresses"


def _register_native_address(port: int) -> str:
    import ray
    from ray.experimental import internal_kv

    replica = serve.get_replica_context().replica_id
    key = f"{replica.deployment_id.app_name}/{replica.unique_id}"
    address = f"{ray.util.get_node_ip_address()}:{port}"
    internal_kv._internal_kv_put(key, address, overwrite=True, namespace=NATIVE_ADDRESSES)
    return key


def _forget_native_address(key: str) -> None:
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key, namespace=NATIVE_ADDRESSES)


def native_addresses(name: str) -> list[str]:
    """Where the application's running replicas serve natively (deployed with a replica port), ``host:port``
    each; empty where they do not. Read while this process is connected to the cluster: each replica records its
    address as it starts, and only replicas Serve reports running are listed (one that died unstopped left its
    record behind)."""
    from ray.experimental import internal_kv
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details().get("applications", {}).get(name, {})
    running = {
        replica["replica_id"]
        for deployment in details.get("deployments", {}).values()
        for replica in deployment.get("replicas", [])
        if replica.get("state") == "RUNNING"
    }
    addresses = []
    for key in internal_kv._internal_kv_list(f"{name}/", namespace=NATIVE_ADDRESSES):
        key = key.decode() if isinstance(key, bytes) else key
        if key.split("/", 1)[1] in running:
            value = internal_kv._internal_kv_get(key, namespace=NATIVE_ADDRESSES)
            addresses.append(value.decode() if isinstance(value, bytes) else value)
    return sorted(addresses)


def _reserved_cpus() -> int:
    try:
        import ray

        reserved = round(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))
        # Ray's CPUs are logical (a node may declare more than its cores): never more threads than cores
        return max(1, min(reserved, usable_cores()))
    except Exception:  # outside a Ray worker (a local test of the class)
        return usable_cores()


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def replica_deployment(
    name: str,
    model_dir: str | Path,
    *,
    min_replicas: int = 1,
    max_replicas: int = 2,
    target_ongoing_requests: float = 8,
    max_ongoing_requests: int = 64,
    replica_cpus: float = 1,
    max_replicas_per_node: int | None = None,
    settings: dict | None = None,
    replica_class: type = OipReplica,
    native_port: int | None = None,
):
    """The application Ray Serve runs for one validated model folder: ``OipReplica`` autoscaled between
    ``min_replicas`` and ``max_replicas`` on ongoing requests per replica, spread over the cluster's nodes; with
    ``native_port``, ``NativeReplica`` serving on that port of its node (0: a free port each), at most one replica
    per node for a fixed port. (``replica_class``: a variant, for benchmarks/bench_ray.py's comparison of
    batching by Ray.)"""
    arguments = (str(Path(model_dir).resolve()), settings)
    if native_port is not None:
        replica_class, arguments = NativeReplica, (*arguments, native_port)
        if native_port:  # two replicas on one node cannot both listen on it
            max_replicas_per_node = 1
    from ray.serve.config import RequestRouterConfig

    deployment = serve.deployment(
        replica_class,
        name=name,
        # every step of a sequence to the replica that holds it, by the id clients send (router.py)
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_PATH, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S
        ),
        autoscaling_config={
            "min_replicas": min_replicas,
            "initial_replicas": min_replicas,
            "max_replicas": max_replicas,
            "target_ongoing_requests": target_ongoing_requests,
        },
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_cpus},
        max_replicas_per_node=max_replicas_per_node,
        health_check_period_s=2,
        health_check_timeout_s=10,
    )
    return deployment.bind(*arguments)


def deploy(
    model_dir: str | Path,
    *,
    address: str = "auto",
    name: str = "mha",
    grpc_port: int = 9000,
    http_port: int = 8000,
    proxy_location: str = "EveryNode",
    **replicas,
) -> str:
    """Deploy ``model_dir`` on the Ray cluster at ``address`` as the Serve application ``name`` and return
    once its replicas serve; it keeps serving after this process exits. Serve is started with the OIP gRPC
    service on ``grpc_port`` unless it already runs (then its proxy's options stay as they are)."""
    import ray
    from ray.serve.config import HTTPOptions, ProxyLocation, gRPCOptions

    ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
    serve.start(
        proxy_location=ProxyLocation(proxy_location),
        http_options=HTTPOptions(host="0.0.0.0", port=http_port),
        grpc_options=gRPCOptions(port=grpc_port, grpc_servicer_functions=[SERVICER_FUNCTION]),
        controller_options={"runtime_env": {"env_vars": {PROXY_READY_TIMEOUT: proxy_ready_timeout_s()}}},
    )
    # An application with no route prefix is invisible to the proxy: every gRPC call names it instead
    # (metadata 'application: NAME').
    serve.run(replica_deployment(name, model_dir, **replicas), name=name, route_prefix=f"/{name}")
    return name


def proxy_ready_timeout_s() -> str:
    """How long Serve's controller gives a proxy it starts to answer ready before it kills it and starts another:
    this command's ``RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S`` if set, else 30 s. Serve's own 5 s is shorter than a
    proxy's start on a busy node (a Python process importing Ray and gRPC), and the first proxy killed fails the
    deploy that waits on it with ``ActorDiedError: ... killed by ray.kill`` although Serve starts another."""
    return os.environ.get(PROXY_READY_TIMEOUT, "30")


def direct_addresses(name: str) -> list[str]:
    """Where the application's replicas answer gRPC themselves, ``host:port`` each: on a cluster whose nodes were
    started with ``RAY_SERVE_ENABLE_DIRECT_INGRESS=1`` (Ray Serve's direct ingress), each ingress replica serves
    the OIP service on a port of its own, no proxy between it and the client (which sends the same 'application'
    metadata). Empty where calls go through the proxies. Read from Serve's controller, the targets it gives load
    balancers, while this process is connected to the cluster."""
    import ray
    from ray.serve._private.common import RequestProtocol
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    proxy_port = client.get_serve_details().get("grpc_options", {}).get("port")
    groups = ray.get(client._controller.get_target_groups.remote(name))
    return [
        f"{target.ip}:{target.port}"
        for group in groups
        if group.protocol == RequestProtocol.GRPC
        for target in group.targets
        if target.port != proxy_port
    ]
