"""The data plane: model state (loading, ready), batched inference off the event loop, statistics and metrics.

Plain Python and numpy: the gRPC layer decodes requests before they get here and encodes after.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np

from mhaserve.signature import ATTN_WEIGHTS, ATTN_WEIGHTS_MEAN, GRAPH_OUTPUT_NAMES

from .batcher import Batcher, BatchResult
from .codec import AttentionRequest, Limits, ModelSignature, RequestError
from .config import ServerSettings
from .metrics import Metrics
from .run_cost import RunCost
from .session import AttentionSession

log = logging.getLogger("mhaserve.server")

MODEL_VERSION = "1"


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass
class BatchStatistics:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class ModelStatistics:
    """Counters in the shape of Triton's statistics extension (durations in nanoseconds)."""

    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)  # decoding and validating the request
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)  # encoding the response
    inference_count: int = 0  # rows (batch elements) inferred
    execution_count: int = 0  # model runs; fewer than requests when batching merges them
    last_inference_ms: int = 0
    batch_sizes: dict[int, BatchStatistics] = field(default_factory=dict)  # per rows in one run
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_success(self, rows: int, timing: RequestTiming) -> None:
        with self.lock:
            self.success.add(timing.total_ns)
            self.queue.add(timing.queue_ns)
            self.compute_input.add(timing.input_ns)
            self.compute_infer.add(timing.infer_ns)
            self.compute_output.add(timing.output_ns)
            self.inference_count += rows
            self.last_inference_ms = int(time.time() * 1000)

    def record_execution(self, run: BatchResult) -> None:
        with self.lock:
            self.execution_count += 1
            per_batch = self.batch_sizes.setdefault(run.batch_size, BatchStatistics())
            per_batch.compute_input.add(run.merge_ns)
            per_batch.compute_infer.add(run.model_ns)
            per_batch.compute_output.add(run.split_ns)

    def record_failure(self, ns: int) -> None:
        with self.lock:
            self.fail.add(ns)


@dataclass
class RequestTiming:
    """Where one request's time went, in nanoseconds."""

    input_ns: int = 0
    queue_ns: int = 0
    infer_ns: int = 0
    output_ns: int = 0

    @property
    def total_ns(self) -> int:
        return self.input_ns + self.queue_ns + self.infer_ns + self.output_ns


class ModelNotReady(RequestError):
    def __init__(self, name: str):
        super().__init__(grpc.StatusCode.UNAVAILABLE, f"model '{name}' is not ready (loading or shutting down)")


class ShuttingDown(RequestError):
    def __init__(self):
        super().__init__(
            grpc.StatusCode.UNAVAILABLE, "the server is shutting down and takes no new requests; retry elsewhere"
        )


class InflightBytesExceeded(RequestError):
    def __init__(self, held: int, needed: int, limit: int):
        super().__init__(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"this request needs {needed} bytes (inputs + outputs) while requests in flight hold {held}; "
            f"together over the limit max_inflight_bytes={limit}; retry later",
        )


def footprint_bytes(request: AttentionRequest, num_heads: int) -> int:
    """Memory a request holds while queued and run: its decoded inputs and the outputs it asked for."""
    inputs = {id(a): a.nbytes for a in (request.query, request.key, request.value, request.mask)}
    b, q_len, d_model = request.query.shape
    kv_len = request.key.shape[1]
    outputs = 4 * b * q_len * d_model  # output is always computed
    if ATTN_WEIGHTS in request.outputs or ATTN_WEIGHTS_MEAN in request.outputs:
        outputs += 4 * b * num_heads * q_len * kv_len  # fetched from the run either way
    if ATTN_WEIGHTS_MEAN in request.outputs:
        outputs += 4 * b * q_len * kv_len
    return sum(inputs.values()) + outputs


def lower_thread_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's nice value (Linux keeps one per thread; new threads inherit it)."""
    if not nice or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + nice)
    except OSError as error:  # a sandbox may forbid it; serving matters more than the priority
        log.warning("could not lower the inference threads' priority (--inference-nice %d): %s", nice, error)


class DataPlane:
    def __init__(self, settings: ServerSettings, model_dir):
        self.settings = settings
        self.model_dir = model_dir
        self.session: AttentionSession | None = None
        self.signature: ModelSignature | None = None
        self.limits = Limits(settings.max_batch_size, settings.max_q_len, settings.max_kv_len)
        self.stats = ModelStatistics()
        self.metrics: Metrics | None = None
        self.ready = False  # loaded and warmed: requests are served
        self.draining = False  # shutting down: in-flight requests finish, ready RPCs say no
        self.inflight_bytes = 0  # footprint_bytes of the requests queued or running (event loop only)
        self.requests_in_flight = 0  # inference calls inside the handler (event loop only)
        self.outcomes: Counter[str] = Counter()  # inference calls by final status since start
        self._executor = ThreadPoolExecutor(
            settings.inference_workers,
            thread_name_prefix="mhaserve-infer",
            initializer=lower_thread_priority,
            initargs=(settings.inference_nice,),
        )
        self.batcher = Batcher(
            self._run_model,
            self._executor,
            workers=settings.inference_workers,
            max_batch_size=settings.max_batch_size,
            max_queue_size=settings.max_queue_size,
            max_queue_delay_s=settings.max_queue_delay_us / 1e6,
            enabled=settings.dynamic_batching,
            on_batch=self._on_batch,
        )

    async def load(self) -> AttentionSession:
        """Create the session and warm it up."""
        # On an inference thread, so that ONNX Runtime's own threads inherit its lower priority.
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._load)

    def _load(self) -> AttentionSession:
        session = AttentionSession(self.model_dir, self.settings.device, self.settings.intra_op_threads)
        session.warm_up(self.settings.warmup_runs)
        if self.settings.dynamic_batching and self.settings.length_aware_batching:
            self.batcher.run_cost = self._fit_run_cost(session)
        self.session = session
        self.signature = ModelSignature(session.info.name, MODEL_VERSION, session.info.d_model, session.info.num_heads)
        self.ready = True
        return session

    def _fit_run_cost(self, session: AttentionSession) -> RunCost:
        d_model = session.info.d_model
        rng = np.random.default_rng(0)

        def run(rows: int, length: int) -> None:
            x = rng.standard_normal((rows, length, d_model), dtype=np.float32)
            session.run(GRAPH_OUTPUT_NAMES, x, x, x, np.ones((1, 1, 1, length), dtype=bool))

        limits = self.limits
        cost = RunCost.fit(run, limits.max_batch_size, min(limits.max_q_len, limits.max_kv_len))
        log.info(
            "run cost model (CPU per run, fitted at warm-up): %.0f us + %.1f ns per token + %.2f ns per query-key pair",
            cost.overhead_s * 1e6,
            cost.per_token_s * 1e9,
            cost.per_pair_s * 1e9,
        )
        return cost

    def start_metrics(self) -> int:
        """The Prometheus endpoint on its own port (after load: labels name the model); returns the port."""
        self.metrics = Metrics(
            self.signature.name, self.signature.version, lambda: self.batcher.queue_depth, lambda: self.inflight_bytes
        )
        return self.metrics.serve(self.settings.host, self.settings.metrics_port)

    @property
    def reports_ready(self) -> bool:
        """What ServerReady, ModelReady and health say: loaded, warmed and not draining."""
        return self.ready and not self.draining

    def require_ready(self) -> ModelSignature:
        if self.draining:
            raise ShuttingDown()
        if not self.ready or self.signature is None:
            raise ModelNotReady(self.signature.name if self.signature else "model")
        return self.signature

    async def infer(self, request: AttentionRequest, timing: RequestTiming, timeout_s: float | None = None):
        """The request's outputs, computed in a (possibly merged) run; fills ``timing``'s queue and infer times.

        Refuses at once (RESOURCE_EXHAUSTED) when the request would take the memory held by requests in
        flight over ``max_inflight_bytes``, or when the queue is full.
        """
        signature = self.require_ready()
        needed = footprint_bytes(request, signature.num_heads)
        limit = self.settings.max_inflight_bytes
        if self.inflight_bytes + needed > limit:
            raise InflightBytesExceeded(self.inflight_bytes, needed, limit)
        self.inflight_bytes += needed
        try:
            answer = await self.batcher.submit(request, timeout_s)
        finally:
            self.inflight_bytes -= needed
        timing.queue_ns, timing.infer_ns = answer.queue_ns, answer.infer_ns
        return answer.outputs

    def record(self, status: str, rows: int, timing: RequestTiming) -> None:
        """One request's fate, for the statistics RPC, the metrics endpoint and the stop line."""
        self.outcomes[status] += 1
        if status == "OK":
            self.stats.record_success(rows, timing)
        else:
            self.stats.record_failure(timing.total_ns)
        if self.metrics is not None:
            self.metrics.request_done(status, rows, timing.total_ns / 1e9, timing.queue_ns / 1e9, timing.infer_ns / 1e9)

    def record_unauthenticated(self, method: str) -> None:
        log.debug("refused %s: missing or wrong bearer token", method)
        if self.metrics is not None:
            self.metrics.unauthenticated()

    def _run_model(self, output_names, query, key, value, mask):
        return self.session.run(output_names, query, key, value, mask)

    def _on_batch(self, run: BatchResult) -> None:
        self.stats.record_execution(run)
        if self.metrics is not None:
            self.metrics.batch_done(run.batch_size, run.padding_ratio)

    def shutdown(self) -> None:
        self.ready = False
        self._executor.shutdown(wait=True)
        if self.metrics is not None:
            self.metrics.close()
