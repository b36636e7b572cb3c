"""The data plane: model state (loading, ready), inference off the event loop, and statistics.

Plain Python and numpy: the gRPC layer decodes requests before they get here and encodes after.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np

from .codec import AttentionRequest, Limits, ModelSignature, RequestError
from .config import ServerSettings
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
    inference_count: int = 0  # batch elements inferred
    execution_count: int = 0  # model runs
    last_inference_ms: int = 0
    batch_sizes: dict[int, BatchStatistics] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_success(self, batch_size: int, timing: RequestTiming) -> None:
        with self.lock:
            self.success.add(timing.total_ns)
            self.queue.add(timing.queue_ns)
            self.compute_input.add(timing.input_ns)
            self.compute_infer.add(timing.infer_ns)
            self.compute_output.add(timing.output_ns)
            self.inference_count += batch_size
            self.execution_count += 1
            self.last_inference_ms = int(time.time() * 1000)
            per_batch = self.batch_sizes.setdefault(batch_size, BatchStatistics())
            per_batch.compute_input.add(timing.input_ns)
            per_batch.compute_infer.add(timing.infer_ns)
            per_batch.compute_output.add(timing.output_ns)

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


class DataPlane:
    def __init__(self, settings: ServerSettings, model_dir):
        self.settings = settings
        self.model_dir = model_dir
        self.session: AttentionSession | None = None
        self.signature: ModelSignature | None = None
        self.limits = Limits(settings.max_batch_size, settings.max_q_len, settings.max_kv_len)
        self.stats = ModelStatistics()
        self.ready = False  # loaded and warmed: requests are served
        self.draining = False  # shutting down: in-flight requests finish, ready RPCs say no
        self._executor = ThreadPoolExecutor(settings.inference_workers, thread_name_prefix="mhaserve-infer")

    def load(self) -> AttentionSession:
        """Create the session and warm it up (blocking: call from a thread)."""
        session = AttentionSession(self.model_dir, self.settings.device, self.settings.intra_op_threads)
        session.warm_up(self.settings.warmup_runs)
        self.session = session
        self.signature = ModelSignature(session.info.name, MODEL_VERSION, session.info.d_model, session.info.num_heads)
        self.ready = True
        return session

    @property
    def reports_ready(self) -> bool:
        """What ServerReady, ModelReady and health say: loaded, warmed and not draining."""
        return self.ready and not self.draining

    def require_ready(self) -> ModelSignature:
        if not self.ready or self.signature is None:
            raise ModelNotReady(self.signature.name if self.signature else "model")
        return self.signature

    async def infer(self, request: AttentionRequest, timing: RequestTiming) -> dict[str, np.ndarray]:
        """Run the model off the event loop; fills ``timing``'s queue and infer times."""
        self.require_ready()
        loop = asyncio.get_running_loop()
        queued = time.perf_counter_ns()
        try:
            outputs, started, finished = await loop.run_in_executor(self._executor, self._run, request)
        except Exception:
            self.stats.record_failure(time.perf_counter_ns() - queued)
            raise
        timing.queue_ns, timing.infer_ns = started - queued, finished - started
        return outputs

    def _run(self, request: AttentionRequest):
        started = time.perf_counter_ns()
        # attn_weights is computed either way (output depends on it); only fetch what was asked.
        arrays = self.session.run(request.outputs, request.query, request.key, request.value, request.mask)
        return dict(zip(request.outputs, arrays, strict=True)), started, time.perf_counter_ns()

    def shutdown(self) -> None:
        self.ready = False  # loaded and warmed: requests are served
        self.draining = False  # shutting down: in-flight requests finish, ready RPCs say no
        self._executor.shutdown(wait=True)
