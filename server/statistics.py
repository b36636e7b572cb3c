"""Per-version counters in the shape of Triton's statistics extension (durations in nanoseconds), and the
records they count: one request's timing, one batched run's result."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from .errors import RequestError


@dataclass
class BatchResult:
    """What one merged run produced, with its timing, for statistics and metrics."""

    answers: list[dict[str, np.ndarray] | None]
    errors: list[RequestError | None]  # per request: why it has no answer (overflow_error)
    batch_size: int  # rows
    q_len: int  # padded to the longest
    kv_len: int
    padding_ratio: float  # Merged.padding_ratio
    started_ns: int
    finished_ns: int
    merge_ns: int
    model_ns: int
    split_ns: int


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
        self.record_run(run.batch_size, run.merge_ns, run.model_ns, run.split_ns)

    def record_run(self, rows: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One run of the model (a merged batch, or steps of sequences), of ``rows`` batch rows."""
        with self.lock:
            self.execution_count += 1
            per_batch = self.batch_sizes.setdefault(rows, BatchStatistics())
            per_batch.compute_input.add(input_ns)
            per_batch.compute_infer.add(infer_ns)
            per_batch.compute_output.add(output_ns)

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
