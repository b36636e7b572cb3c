"""The server: one object whose life is named phases (bind, load, serve, drain, stop), and the process that
runs it until SIGTERM or SIGINT. Tests drive the same phases in their own process."""

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
from grpc_reflection.v1alpha import reflection, reflection_pb2

from mhaserve.contract.model_dir import ModelDirError
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.pool import POOL, add_file

from . import describe, logs
from .config import ServerSettings, web_origins
from .cores import limit_said
from .dataplane import DataPlane
from .grpc.handlers import add_inference_service
from .grpc.receipt import STREAM_WINDOW_BYTES
from .grpc.servicer import InferenceServicer
from .malloc import tune_malloc
from .ports import bind_failure, host_port
from .rest.prometheus import exposition_of, start_metrics
from .rest.routes import RestTransport
from .rest.site import start_site
from .security import (
    BearerTokenInterceptor,
    Callers,
    SecurityConfigError,
    Tokens,
    load_token,
    server_credentials,
    server_ssl_context,
)
from .session import DeviceUnavailable
from .tracing import TracingUnavailable
from .worker_forward import StepForwarder, serve_forwarded
from .workers import RESTARTED_ENV, WORKER_ENV, is_worker, peers_statistics

log = logging.getLogger("mhaserve.server")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
HEALTH_SERVICES = ("", SERVICE_NAME)


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


class StartFailed(Exception):
    """The server cannot serve: the reason, one line, and the process's exit code (2: a setting or a port;
    3: what it was asked to serve)."""

    def __init__(self, reason: str, exit_code: int):
        super().__init__(reason)
        self.reason, self.exit_code = reason, exit_code


class Server:
    """One server, gRPC and HTTP/REST on one data plane, in phases on the running event loop:

    - ``bind``: the ports open; health and the ready RPCs say NOT_SERVING, probes answer;
    - ``load``: the models of start-up load and warm, then the metrics port opens;
    - ``serve``: SERVING, the background tasks start, the serving line is logged;
    - ``drain``: NOT_SERVING, new calls refused (retryable), in-flight ones get the grace period;
    - ``stop``: the ports close, the workers end, spans are flushed, the stop line is logged.

    ``bind`` and ``load`` raise StartFailed; after a failure ``stop`` closes what was opened."""

    def __init__(self, settings: ServerSettings, model_dir=None):
        self.settings = settings
        self.model_dir = model_dir if model_dir is not None else settings.model_dir
        self.dataplane: DataPlane | None = None
        self.port = 0  # gRPC's, once bound
        self.http_address = "off"
        self.metrics_address = "off"
        self._grpc: grpc.aio.Server | None = None
        self._health: BoundedHealthServicer | None = None
        self._credentials = None
        self._token: Tokens | None = None
        self.callers = Callers()  # who is who, once the security settings are read
        self._http_runner = None
        self._metrics_runner = None
        self._tasks: list[asyncio.Task] = []
        self._served = False  # ``serve`` ran: ``stop`` logs the calls' outcomes
        self._draining_since: float | None = None
        self._forwarder: StepForwarder | None = None  # one of --workers: steps of sequences other workers hold
        self._forwarded: asyncio.AbstractServer | None = None  # where the other workers forward this one's steps

    # -- bind -------------------------------------------------------------------------------------------

    async def bind(self) -> None:
        settings = self.settings
        try:
            worker = int(os.environ[WORKER_ENV]) if is_worker() else None
            self._forwarder = None if worker is None else StepForwarder.from_env(worker)
            dataplane = DataPlane(settings, self.model_dir, peers_statistics if is_worker() else None, self._forwarder)
            self.dataplane = dataplane
            if (restarted := os.environ.get(RESTARTED_ENV)) is not None:
                dataplane.sequences.lost_before(f"when worker {worker} of this server restarted at {restarted}")
        except TracingUnavailable as error:
            raise StartFailed(f"cannot trace: {error}", 2) from None
        # The port is bound before the models load (health says NOT_SERVING meanwhile), so the message limits
        # come from the manifests' sizes rather than the sessions: the largest of what start-up may serve.
        try:
            configs = dataplane.model_configs()
        except ModelDirError as error:
            raise StartFailed(f"cannot serve: {error}", 3) from None
        if settings.model_repository and not settings.model_repository.is_dir():
            raise StartFailed(f"cannot serve: --model-repository {settings.model_repository} is not a folder", 3)
        limits = [settings.message_limits(c["d_model"], c["num_heads"]) for c in configs]
        limits = limits or [settings.message_limits(512, 8)]  # an empty repository: models added later
        receive_limit, send_limit = max(r for r, _ in limits), max(s for _, s in limits)
        dataplane.versions.message_limits = (receive_limit, send_limit)
        try:
            self._credentials = server_credentials(
                settings.tls_cert_file, settings.tls_key_file, settings.tls_client_ca_file
            )
            self._token = load_token(settings.auth_token_file)
            self.callers = Callers(self._token, certificates=settings.tls_client_ca_file is not None)
        except SecurityConfigError as error:
            raise StartFailed(f"cannot serve: {error}", 2) from None
        self._warn_about_exposure()
        self._grpc = self._grpc_server(receive_limit, send_limit)
        self._receive_limit = receive_limit
        if not is_worker():  # probes answer (NOT_SERVING) while the models load
            await self.listen()

    async def listen(self) -> None:
        """Bind the gRPC and HTTP ports and start answering. One of --workers listens only once its models are
        loaded: the kernel spreads connections over the listening workers, so none is sent to one still loading
        (a restarted worker's), while the others serve."""
        settings = self.settings
        if self._forwarder is not None:
            own = self._forwarder.sockets[self._forwarder.own]
            self._forwarded = await serve_forwarded(self.dataplane, own)
        address = host_port(settings.host, settings.port)
        try:
            if self._credentials is not None:
                port = self._grpc.add_secure_port(address, self._credentials)
            else:
                port = self._grpc.add_insecure_port(address)
        except RuntimeError:  # grpcio: "Failed to bind to address ..."
            port = 0
        if port == 0:
            raise StartFailed(f"cannot serve: {bind_failure(('--port', settings.host, settings.port))}", 2)
        self.port = port
        for service in HEALTH_SERVICES:
            await self._health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._grpc.start()
        try:  # the same protocol over HTTP/REST, on this loop and this data plane; probes answer during the load
            self._http_runner, self.http_address = await start_rest(
                settings, self.dataplane, self.callers, self._receive_limit
            )
        except (OSError, SecurityConfigError) as error:
            if getattr(error, "errno", None) == errno.EADDRINUSE:
                reason = f"cannot serve: {bind_failure(('--http-port', settings.host, settings.http_port))}"
            else:
                reason = f"could not start HTTP/REST on {host_port(settings.host, settings.http_port)}: {error}"
            raise StartFailed(reason, 2) from None

    def _warn_about_exposure(self) -> None:
        settings = self.settings
        on_loopback = settings.host in ("127.0.0.1", "localhost", "::1")
        if self._token is not None and self._credentials is None and not on_loopback:
            log.warning("a bearer token over plain text can be read by anyone on the network: use TLS as well")
        if settings.allow_client_shm and not on_loopback:
            log.warning(
                "--allow-client-shm true with --host %s: shared memory is refused (PERMISSION_DENIED, HTTP 403) to "
                "every caller not on loopback; clients on other hosts send their tensors in the request",
                settings.host,
            )

    def _grpc_server(self, receive_limit: int, send_limit: int) -> grpc.aio.Server:
        settings, dataplane, token = self.settings, self.dataplane, self._token
        server = grpc.aio.server(
            interceptors=[BearerTokenInterceptor(token, dataplane.record_unauthenticated)] if token else [],
            options=[
                ("grpc.max_receive_message_length", receive_limit),
                ("grpc.max_send_message_length", send_limit),
                ("grpc.max_concurrent_streams", settings.max_concurrent_streams),
                ("grpc.max_allowed_incoming_connections", settings.grpc_max_connections),
                # A request not yet read is held to the stream's initial window; BDP probing would grow windows
                # to megabytes per connection, received whether or not a handler reads them.
                ("grpc.http2.bdp_probe", 0),
                ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
                # Off by default, so a second server on a taken port fails loudly instead of sharing it.
                ("grpc.so_reuseport", int(settings.reuse_port)),
                ("grpc.keepalive_time_ms", int(settings.keepalive_time_s * 1000)),
                ("grpc.keepalive_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
                ("grpc.http2.ping_timeout_ms", int(settings.keepalive_timeout_s * 1000)),
                ("grpc.keepalive_permit_without_calls", 1),  # a dead idle connection is found too
                ("grpc.http2.max_pings_without_data", 0),
            ],
        )
        self._health = BoundedHealthServicer(settings.max_health_watchers)
        add_inference_service(InferenceServicer(dataplane, callers=self.callers), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        health_service = health_pb2.DESCRIPTOR.services_by_name["Health"]
        for described in (health_pb2.DESCRIPTOR, reflection_pb2.DESCRIPTOR):
            add_file(described)  # reflection reads one pool: the protocol's, which holds them all
        names = (SERVICE_NAME, health_service.full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server, POOL)
        return server

    # -- load -------------------------------------------------------------------------------------------

    async def load(self) -> None:
        settings = self.settings
        if not is_worker() and (limited := limit_said()):  # the workers' parent says it for them
            log.info(limited)
        try:
            await self.dataplane.start()
        except (ModelDirError, DeviceUnavailable, ValueError) as error:
            raise StartFailed(f"cannot serve: {error}", 3) from None
        if self._forwarder is not None and os.environ.get(RESTARTED_ENV) is not None:
            # in place of a worker that exited: the models loaded and the regions registered since the start
            state = await self._forwarder.state_of_another()
            if state is not None:
                await self.dataplane.take_control_state(state)
        try:
            own_statistics = None
            if is_worker():  # the other workers add this one's statistics to theirs
                served = self.dataplane.served_models
                own_statistics = lambda: [describe.model_statistics(m) for m in served()]  # noqa: E731
            self._metrics_runner, self.metrics_address = await start_metrics(
                settings, exposition_of(self.dataplane.metrics), own_statistics
            )
        except OSError as error:
            if error.errno == errno.EADDRINUSE:
                busy = bind_failure(("--metrics-port", settings.metrics_host, settings.metrics_port))
                reason = f"cannot serve: {busy}"
            else:
                where = host_port(settings.metrics_host, settings.metrics_port)
                reason = f"could not start the metrics endpoint on {where}: {error}"
            raise StartFailed(reason, 2) from None

    # -- serve ------------------------------------------------------------------------------------------

    async def serve(self) -> None:
        settings, dataplane = self.settings, self.dataplane
        for service in HEALTH_SERVICES:
            await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if settings.model_repository and settings.model_control_mode == "poll":
            self._tasks.append(asyncio.create_task(dataplane.poll_repository()))
        self._tasks.append(asyncio.create_task(dataplane.drop_idle_sequences()))
        self._served = True
        line = self.serving_line()
        if (worker := os.environ.get(WORKER_ENV)) is not None:  # one of --workers: the parent says "serving"
            line = line.replace("serving ", f"worker {worker} ready: ", 1)
        log.info("%s", line)

    def serving_line(self) -> str:
        """What serves and how: the line that says the server is up (tests and scripts read its addresses)."""
        settings = self.settings
        served = self.dataplane.served_models()
        models = "; ".join(
            f"model={m.signature.name} version={m.signature.version} d_model={m.signature.d_model} "
            f"heads={m.signature.num_heads} precision={m.signature.precision} opset={m.batched.graphs.info.opset}"
            for m in served
        )
        receive_limit, send_limit = self.dataplane.versions.message_limits
        tls = ("mutual" if settings.tls_client_ca_file else "on") if self._credentials else "off"
        level_policies = settings.priority_queue_policy and f" priority_queue_policy={settings.priority_queue_policy}"
        return (
            f"serving {models or 'model=none'} repository={settings.model_repository or 'off'} "
            f"control={settings.model_control_mode if settings.model_repository else 'none'} "
            f"provider={served[0].batched.graphs.provider if served else '-'} "
            f"intra_op_threads={served[0].batched.graphs.intra_op_threads if served else settings.intra_op_threads} "
            f"inference_workers={settings.inference_workers} batching={'on' if settings.dynamic_batching else 'off'} "
            f"max_batch_size={settings.max_batch_size} max_queue_delay_us={settings.max_queue_delay_us} "
            f"max_queue_size={settings.max_queue_size} queue_timeout_us={settings.queue_timeout_us} "
            f"priority_levels={settings.priority_levels}{level_policies} max_receive_bytes={receive_limit} "
            f"max_send_bytes={send_limit} max_inflight_bytes={settings.max_inflight_bytes} "
            f"tls={tls} auth={'token' if self._token else 'off'} metrics={self.metrics_address} "
            f"http={self.http_address} address={host_port(settings.host, self.port)}"
        )

    async def wait_for_termination(self) -> None:
        """Until gRPC stops by itself (it does not, unless stopped)."""
        await self._grpc.wait_for_termination()

    # -- drain and stop ---------------------------------------------------------------------------------

    async def drain(self) -> None:
        """In-flight requests keep running; the ready RPCs and health report the drain, and new calls get
        UNAVAILABLE "shutting down" (retryable) from the handler. The port stays open for drain_seconds
        first: calls that had reached gRPC but not yet a handler would otherwise be cut off by the server's
        stop with a bare CANCELLED, which clients do not retry."""
        settings = self.settings
        self._draining_since = time.monotonic()
        log.info("shutting down: NOT_SERVING, refusing new requests, %.1f s for in-flight ones", settings.grace_seconds)
        self._cancel_tasks()
        self.dataplane.drain(settings.drain_seconds)
        await self._health.enter_graceful_shutdown()
        await asyncio.sleep(settings.drain_seconds)
        await asyncio.gather(self._grpc.stop(settings.grace_seconds), _stop_runner(self._http_runner))
        self._http_runner = None

    async def close_ports(self) -> None:
        if self._forwarded is not None:
            self._forwarded.close()
        if self._forwarder is not None:
            self._forwarder.close()
        if self._grpc is not None:
            await self._grpc.stop(0)
        await _stop_runner(self._http_runner)
        await _stop_runner(self._metrics_runner)
        self._http_runner = self._metrics_runner = None

    async def stop(self) -> None:
        """Close what is open (in-flight calls are cut off unless ``drain`` ran first), end the workers, flush
        the spans not yet exported within what is left of the grace period, and log the stop line (after a
        failed start, only the closing)."""
        settings = self.settings
        self._cancel_tasks()
        stopping_since = self._draining_since or time.monotonic()
        await self.close_ports()
        dataplane = self.dataplane
        if dataplane is None:
            return
        await asyncio.to_thread(dataplane.shutdown)
        if not self._served:
            return
        flush_s = max(0.5, settings.grace_seconds - (time.monotonic() - stopping_since))  # half a second at least
        await asyncio.to_thread(dataplane.tracing.shutdown, flush_s)
        # Calls still inside the handler when the grace period ended were cut off: say how many.
        outcomes = ", ".join(f"{status} {n}" for status, n in sorted(dataplane.accounting.outcomes.items())) or "none"
        log.info(
            "stopped: inference calls by status: %s; %d in flight at exit",
            outcomes,
            dataplane.accounting.requests_in_flight,
        )

    def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []


async def start_rest(settings: ServerSettings, dataplane: DataPlane, callers: Callers, body_limit: int):
    """The HTTP/REST port: (its runner, "host:port"), or (None, "off")."""
    if settings.http_port < 0:
        return None, "off"
    transport = RestTransport(
        dataplane,
        callers,
        body_limit,
        settings.http_read_timeout_s,
        settings.write_timeout_s,
        cors_origins=web_origins(settings.http_cors_origins),
    )
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
        reuse_port=settings.reuse_port,  # the kernel spreads connections over the processes sharing it
    )
    return runner, host_port(settings.host, port)


async def _stop_runner(runner) -> None:
    if runner is not None:
        await runner.cleanup()


class LoadAbandoned(Exception):
    """SIGTERM or SIGINT came while the model was loading."""


async def serve(settings: ServerSettings, model_dir) -> int:
    """The process's server: run until SIGTERM or SIGINT (then drain); return the exit code."""
    server = Server(settings, model_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await server.bind()
        # SIGTERM during a load (a large model takes a while) stops the process then, not after the load.
        loading = asyncio.ensure_future(server.load())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not loading.done():
            log.info("stopped while loading the model: nothing was served")
            await server.close_ports()
            raise LoadAbandoned
        stopping.cancel()
        loading.result()
        if not server.port:  # one of --workers: it listens once loaded
            await server.listen()
    except StartFailed as failure:
        log.error("%s", failure.reason)
        await server.stop()
        return failure.exit_code
    # What start-up made (modules, the sessions, gRPC's objects) lives as long as the process. Frozen, a
    # full collection, when one comes under load, no longer walks it (BENCHMARKS.md, "Figures behind the
    # server's defaults"). Refcounting still frees what start-up drops later.
    gc.collect()
    gc.freeze()
    await server.serve()
    stop_task = asyncio.create_task(stop.wait())
    done_task = asyncio.create_task(server.wait_for_termination())
    await asyncio.wait({stop_task, done_task}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        await server.drain()
    await server.stop()
    return 0


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
