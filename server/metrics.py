"""Prometheus metrics on their own HTTP port, named after Triton's ``nv_inference_*`` family.

Triton name                          here
nv_inference_request_success/failure mhaserve_inference_request_total{status="OK"|gRPC code}
nv_inference_count                   mhaserve_inference_count_total (rows inferred)
nv_inference_exec_count              mhaserve_inference_exec_count_total (model runs)
nv_inference_request_duration_us     mhaserve_inference_request_duration_seconds (histogram)
nv_inference_queue_duration_us       mhaserve_inference_queue_duration_seconds (histogram)
nv_inference_compute_infer_duration  mhaserve_inference_compute_infer_duration_seconds (histogram)
nv_inference_pending_request_count   mhaserve_inference_pending_request_count (queue depth)
(batch sizes)                        mhaserve_inference_batch_size (histogram of rows per run)
(memory held by requests)            mhaserve_inference_inflight_bytes (inputs + outputs, queued or running)
(refused credentials)                mhaserve_unauthenticated_request_total

Durations are in seconds, Prometheus' base unit, rather than Triton's microsecond counters.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# 50 µs .. ~3 s, roughly x2 apart: covers a [1,16,512] run and a long queue under overload.
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PADDING_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class Metrics:
    def __init__(
        self, model: str, version: str, queue_depth: Callable[[], int], inflight_bytes: Callable[[], int] = lambda: 0
    ):
        self.registry = CollectorRegistry()
        labels = ("model", "version")
        self._label_values = (model, version)
        self._requests = Counter(
            "mhaserve_inference_request",
            "Inference requests by final gRPC status (OK or the error code)",
            (*labels, "status"),
            registry=self.registry,
        )
        self._by_status: dict[str, Counter] = {}
        self._count = Counter(
            "mhaserve_inference_count", "Rows (batch elements) inferred", labels, registry=self.registry
        ).labels(model, version)
        self._exec_count = Counter(
            "mhaserve_inference_exec_count", "Model runs (one per merged batch)", labels, registry=self.registry
        ).labels(model, version)

        def histogram(name, text, buckets=LATENCY_BUCKETS):
            return Histogram(name, text, labels, buckets=buckets, registry=self.registry).labels(model, version)

        self._request_seconds = histogram(
            "mhaserve_inference_request_duration_seconds", "Whole request in the server: decode, queue, run, encode"
        )
        self._queue_seconds = histogram(
            "mhaserve_inference_queue_duration_seconds", "Time a request waited for a worker"
        )
        self._compute_seconds = histogram(
            "mhaserve_inference_compute_infer_duration_seconds", "Model run (merge, ONNX Runtime, split) per request"
        )
        self._batch_size = histogram("mhaserve_inference_batch_size", "Rows per model run", BATCH_BUCKETS)
        self._padding = histogram(
            "mhaserve_inference_padding_ratio",
            "Share of a model run's query-key pairs that are padding (requests of different lengths in one run)",
            PADDING_BUCKETS,
        )
        pending = Gauge(
            "mhaserve_inference_pending_request_count", "Requests waiting in the queue", labels, registry=self.registry
        )
        pending.labels(model, version).set_function(queue_depth)
        held = Gauge(
            "mhaserve_inference_inflight_bytes",
            "Bytes held by queued and running requests (inputs and requested outputs)",
            labels,
            registry=self.registry,
        )
        held.labels(model, version).set_function(inflight_bytes)
        self._unauthenticated = Counter(
            "mhaserve_unauthenticated_request",
            "RPCs refused for a missing or wrong bearer token",
            registry=self.registry,
        )
        self.server = None

    def request_done(self, status: str, rows: int = 0, total_s=None, queue_s=None, compute_s=None) -> None:
        counter = self._by_status.get(status)
        if counter is None:
            counter = self._by_status[status] = self._requests.labels(*self._label_values, status)
        counter.inc()
        if status == "OK":
            self._count.inc(rows)
            self._request_seconds.observe(total_s)
            self._queue_seconds.observe(queue_s)
            self._compute_seconds.observe(compute_s)

    def unauthenticated(self) -> None:
        self._unauthenticated.inc()

    def batch_done(self, rows: int, padding_ratio: float = 0.0) -> None:
        self._exec_count.inc()
        self._batch_size.observe(rows)
        self._padding.observe(padding_ratio)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint (its own thread); returns the bound port (``port`` 0 picks one)."""
        self.server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self.server.server_port

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
