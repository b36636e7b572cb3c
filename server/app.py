"""The server process: bind, report NOT_SERVING, load and warm the model, report SERVING, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from mhaserve.contract.model_dir import ModelDirError
from mhaserve.protos.generated import grpc_service_pb2 as pb

from . import logs
from .config import ServerSettings
from .dataplane import DataPlane
from .grpc.servicer import InferenceServicer, add_inference_service
from .malloc import tune_malloc
from .ports import bind_failure
from .rest.prometheus import start_metrics
from .rest.routes import RestTransport
from .rest.site import start_site
from .security import (
    BearerTokenInterceptor,
    SecurityConfigError,
    load_token,
    server_credentials,
    server_ssl_context,
)
from .session import DeviceUnavailable
from .tracing import TracingUnavailable

log = logging.getLogger("mhaserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name


class BoundedHealthServicer(health.aio.HealthServicer):
    """grpc.health.v1 with a cap on Watch streams open at once: each holds a task and its buffers for as
    long as the client keeps it, and health needs no token (BENCHMARKS.md, "Figures behind the server's defaults")."""

    def __init__(self, max_watchers: int):
        super().__init__()
        self._max_watchers = max_watchers
        self._watchers = 0

    async def Watch(self, request, context) -> None:
        if self._watchers >= self._max_watchers:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._watchers} health Watch streams are open, the limit max_health_watchers="
                f"{self._max_watchers}; use Check, or retry later",
            )
        self._watchers += 1
        try:
            await super().Watch(request, context)
        finally:
            self._watchers -= 1


async def serve(settings: ServerSettings, model_dir) -> int:
    """Run until SIGTERM or SIGINT; return the exit code."""
    try:
        dataplane = DataPlane(settings, model_dir)
    except TracingUnavailable as error:
        log.error("cannot trace: %s", error)
        return 2
    health_servicer = BoundedHealthServicer(settings.max_health_watchers)
    # The port is bound before the models load (health says NOT_SERVING meanwhile), so the message limits
    # come from the manifests' sizes rather than the sessions: the largest of what start-up may serve.
    try:
        configs = dataplane.model_configs()
    except ModelDirError as error:
        log.error("cannot serve: %s", error)
        return 3
    if settings.model_repository and not settings.model_repository.is_dir():
        log.error("cannot serve: --model-repository %s is not a folder", settings.model_repository)
        return 3
    limits = [settings.message_limits(c["d_model"], c["num_heads"]) for c in configs]
    limits = limits or [settings.message_limits(512, 8)]  # an empty repository: models added later
    receive_limit, send_limit = max(r for r, _ in limits), max(s for _, s in limits)
    dataplane.versions.message_limits = (receive_limit, send_limit)
    try:
        credentials = server_credentials(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
        token = load_token(settings.auth_token_file)
    except SecurityConfigError as error:
        log.error("cannot serve: %s", error)
        return 2
    on_loopback = settings.host in ("127.0.0.1", "localhost", "::1")
    if token is not None and credentials is None and not on_loopback:
        log.warning("a bearer token over plain text can be read by anyone on the network: use TLS as well")
    if settings.allow_client_shm and not on_loopback:
        log.warning(
            "--allow-client-shm true with --host %s: shared memory is refused (PERMISSION_DENIED, HTTP 403) to "
            "every caller not on loopback; clients on other hosts send their tensors in the request",
            settings.host,
        )
    server = grpc.aio.server(
        interceptors=[BearerTokenInterceptor(token, dataplane.record_unauthenticated)] if token else [],
        options=[
            ("grpc.max_receive_message_length", receive_limit),
            ("grpc.max_send_message_length", send_limit),
            ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
            # Closed before their first byte is read. grpcio's core receives each message whole, before any handler
            # can count or refuse it: connections x streams x the receive limit bounds what it holds.
            ("grpc.max_allowed_incoming_connections", settings.grpc_max_connections),
            # Off by default, so a second server on a taken port fails loudly instead of sharing it.
            ("grpc.so_reuseport", int(settings.reuse_port)),
            ("grpc.keepalive_time_ms", int(settings.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),  # a dead idle connection is found too
            ("grpc.http2.max_pings_without_data", 0),
        ],
    )
    add_inference_service(InferenceServicer(dataplane), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{settings.host}:{settings.port}"
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # grpcio: "Failed to bind to address ..."
        port = 0
    if port == 0:
        log.error("cannot serve: %s", bind_failure("--port", settings.host, settings.port))
        return 2
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.start()
    try:  # the same protocol over HTTP/REST, on this loop and this data plane; probes answer during the load
        http_runner, http_address = await start_rest(settings, dataplane, token, receive_limit)
    except (OSError, SecurityConfigError) as error:
        if getattr(error, "errno", None) == errno.EADDRINUSE:
            log.error("cannot serve: %s", bind_failure("--http-port", settings.host, settings.http_port))
        else:
            log.error("could not start HTTP/REST on %s:%s: %s", settings.host, settings.http_port, error)
        await server.stop(0)
        return 2

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    # SIGTERM during a load (a large model takes a while) stops the process then, not after the load.
    loading = asyncio.ensure_future(dataplane.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():
        log.info("stopped while loading the model: nothing was served")
        await server.stop(0)
        raise LoadAbandoned
    stopping.cancel()
    try:
        loading.result()
    except (ModelDirError, DeviceUnavailable, ValueError) as error:
        log.error("cannot serve: %s", error)
        await asyncio.gather(server.stop(0), _stop_rest(http_runner))
        return 3
    try:
        metrics_runner, metrics_address = await start_metrics(settings, dataplane.metrics)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            log.error("cannot serve: %s", bind_failure("--metrics-port", settings.metrics_host, settings.metrics_port))
        else:
            log.error(
                "could not start the metrics endpoint on %s:%s: %s", settings.metrics_host, settings.metrics_port, error
            )
        await asyncio.gather(server.stop(0), _stop_rest(http_runner))
        return 2
    # What start-up made (modules, the sessions, gRPC: 40k objects) lives as long as the process. Frozen, a
    # full collection, when one comes under load, no longer walks it (BENCHMARKS.md, "Figures behind the
    # server's defaults"). Refcounting still frees what start-up drops later.
    gc.collect()
    gc.freeze()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    polling = None
    if settings.model_repository and settings.model_control_mode == "poll":
        polling = asyncio.create_task(dataplane.poll_repository())
    reaping = asyncio.create_task(dataplane.drop_idle_sequences())
    served = dataplane.served_models()
    log.info(
        "serving %s repository=%s control=%s provider=%s intra_op_threads=%d workers=%d "
        "batching=%s max_batch_size=%d max_queue_delay_us=%d max_queue_size=%d max_receive_bytes=%d max_send_bytes=%d "
        "max_inflight_bytes=%d "
        "tls=%s auth=%s metrics=%s http=%s address=%s:%d",
        "; ".join(
            f"model={m.signature.name} version={m.signature.version} d_model={m.signature.d_model} "
            f"heads={m.signature.num_heads} precision={m.signature.precision} opset={m.session.info.opset}"
            for m in served
        )
        or "model=none",
        settings.model_repository or "off",
        settings.model_control_mode if settings.model_repository else "none",
        served[0].session.provider if served else "-",
        served[0].session.intra_op_threads if served else settings.intra_op_threads,
        settings.inference_workers,
        "on" if settings.dynamic_batching else "off",
        settings.max_batch_size,
        settings.max_queue_delay_us,
        settings.max_queue_size,
        receive_limit,
        send_limit,
        settings.max_inflight_bytes,
        ("mutual" if settings.tls_client_ca_file else "on") if credentials else "off",
        "token" if token else "off",
        metrics_address,
        http_address,
        settings.host,
        port,
    )

    stop_task = asyncio.create_task(stop.wait())
    done_task = asyncio.create_task(server.wait_for_termination())
    await asyncio.wait({stop_task, done_task}, return_when=asyncio.FIRST_COMPLETED)
    if polling is not None:
        polling.cancel()
    reaping.cancel()
    stopping_since = time.monotonic()
    if stop.is_set():
        log.info(
            "shutting down: NOT_SERVING, refusing new requests, %.1f s for in-flight ones",
            settings.grace_seconds,
        )
        # In-flight requests keep running; the ready RPCs and health report the drain, and new calls get
        # UNAVAILABLE "shutting down" (retryable) from the handler. The port stays open for drain_seconds
        # first: calls that had reached gRPC but not yet a handler would otherwise be cut off by the
        # server's stop with a bare CANCELLED, which clients do not retry.
        dataplane.draining = True
        await health_servicer.enter_graceful_shutdown()
        await asyncio.sleep(settings.drain_seconds)
        await asyncio.gather(server.stop(settings.grace_seconds), _stop_rest(http_runner))
    else:
        await _stop_rest(http_runner)
    await _stop_rest(metrics_runner)
    await asyncio.to_thread(dataplane.shutdown)
    # The spans not yet exported, in what is left of the grace period (half a second at least).
    flush_s = max(0.5, settings.grace_seconds - (time.monotonic() - stopping_since))
    await asyncio.to_thread(dataplane.tracing.shutdown, flush_s)
    # Calls still inside the handler when the grace period ended were cut off: say how many.
    outcomes = ", ".join(f"{status} {n}" for status, n in sorted(dataplane.accounting.outcomes.items())) or "none"
    log.info(
        "stopped: inference calls by status: %s; %d in flight at exit",
        outcomes,
        dataplane.accounting.requests_in_flight,
    )
    return 0


async def start_rest(settings: ServerSettings, dataplane: DataPlane, token, body_limit: int):
    """The HTTP/REST port: (its runner, "host:port"), or (None, "off")."""
    if settings.http_port < 0:
        return None, "off"
    transport = RestTransport(dataplane, token, body_limit, settings.http_read_timeout_s, settings.write_timeout_s)
    context = server_ssl_context(settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file)
    runner, port = await start_site(
        transport.application(),
        settings.host,
        settings.http_port,
        ssl_context=context,
        max_connections=settings.http_max_connections,
        idle_timeout_s=settings.http_idle_timeout_s,
        shutdown_timeout_s=settings.grace_seconds,  # in-flight HTTP requests get the same grace as gRPC's
        what="HTTP",
    )
    return runner, f"{settings.host}:{port}"


async def _stop_rest(runner) -> None:
    if runner is not None:
        await runner.cleanup()


class LoadAbandoned(Exception):
    """SIGTERM or SIGINT came while the model was loading."""


def run(settings: ServerSettings, model_dir) -> int:
    logs.configure(settings.log_level, settings.log_format, settings.access_log)
    tune_malloc()
    try:
        return asyncio.run(serve(settings, model_dir))
    except LoadAbandoned:
        # The load runs on in an inference thread (ONNX Runtime cannot be interrupted), and a normal exit
        # would wait for it: leave now, as asked. Nothing was served, so nothing is lost.
        logging.shutdown()
        os._exit(0)
