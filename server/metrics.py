"""Prometheus metrics (served on their own HTTP port by the process), named after Triton's ``nv_inference_*`` family.

Triton name                          here
nv_inference_request_success/failure mhaserve_inference_request_total{status="OK"|gRPC code, protocol=grpc|http|ray}
nv_inference_count                   mhaserve_inference_count_total (rows inferred)
nv_inference_exec_count              mhaserve_inference_exec_count_total (model runs)
nv_inference_request_duration_us     mhaserve_inference_request_duration_seconds (histogram)
nv_inference_queue_duration_us       mhaserve_inference_queue_duration_seconds (histogram)
nv_inference_compute_infer_duration  mhaserve_inference_compute_infer_duration_seconds (histogram)
nv_inference_pending_request_count   mhaserve_inference_pending_request_count (queue depth)
(batch sizes)                        mhaserve_inference_batch_size (histogram of rows per run)
(memory held by requests)            mhaserve_inference_inflight_bytes (inputs, answers, run workspace)
(its limit)                          mhaserve_inference_inflight_bytes_limit (--max-inflight-bytes)
(refused credentials)                mhaserve_unauthenticated_request_total

Durations are in seconds, Prometheus' base unit, rather than Triton's microsecond counters.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# 50 µs .. ~3 s, roughly x2 apart: covers a [1,16,512] run and a long queue under overload.
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PADDING_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class Metrics:
    """The process's metric families; each served version gets its labelled children (``for_model``), which
    ``forget`` removes when it is unloaded, so labels name only models that exist (bounded cardinality)."""

    def __init__(self, inflight_bytes: Callable[[], int] = lambda: 0, inflight_limit: int = 0):
        self.registry = CollectorRegistry()
        labels = ("model", "version")
        self._requests = Counter(
            "mhaserve_inference_request",
            "Inference requests by final status (OK or the error code) and protocol (grpc or http); model and "
            "version empty for requests that named no served model",
            (*labels, "status", "protocol"),
            registry=self.registry,
        )
        self._count = Counter(
            "mhaserve_inference_count", "Rows (batch elements) inferred", labels, registry=self.registry
        )
        self._exec_count = Counter(
            "mhaserve_inference_exec_count", "Model runs (one per merged batch)", labels, registry=self.registry
        )

        def histogram(name, text, buckets=LATENCY_BUCKETS):
            return Histogram(name, text, labels, buckets=buckets, registry=self.registry)

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
        self._pending = Gauge(
            "mhaserve_inference_pending_request_count", "Requests waiting in the queue", labels, registry=self.registry
        )
        held = Gauge(
            "mhaserve_inference_inflight_bytes",
            "Bytes of --max-inflight-bytes taken by requests of every model (inputs, answers, run workspace)",
            registry=self.registry,
        )
        held.set_function(inflight_bytes)
        Gauge(
            "mhaserve_inference_inflight_bytes_limit", "--max-inflight-bytes: the most requests may take",
            registry=self.registry,
        ).set(inflight_limit)  # fmt: skip
        self._unauthenticated = Counter(
            "mhaserve_unauthenticated_request",
            "RPCs refused for a missing or wrong bearer token",
            registry=self.registry,
        )
        self._sequences = None  # the data plane's Sequences, once watched
        self.sequence_step_runs = 0  # runs of step graphs, each of one or more sequences' steps
        self.registry.register(_SequenceCollector(self))
        self._families = (
            self._count, self._exec_count, self._request_seconds, self._queue_seconds, self._compute_seconds,
            self._batch_size, self._padding, self._pending,
        )  # fmt: skip
        # The request counter's children by (model, version, status, protocol): looked up per request without
        # prometheus_client's lock, and the record of which children forget() removes.
        self._request_counters: dict[tuple[str, str, str, str], Counter] = {}
        self._queue_depths: dict[tuple[str, str], Callable[[], int]] = {}
        self._models: dict[tuple[str, str], ModelMetrics] = {}

    def watch_sequences(self, sequences) -> None:
        self._sequences = sequences

    def step_runs_made(self, runs: int) -> None:
        self.sequence_step_runs += runs

    def for_model(self, model: str, version: str, queue_depth: Callable[[], int]) -> ModelMetrics:
        # The gauge keeps its function in a reference cycle (prometheus_client's set_function), which only the
        # garbage collector breaks: it is given a lookup instead, so an unloaded version's batcher and session
        # are freed when forget() drops them, not whenever a collection comes.
        key = (model, version)
        self._queue_depths[key] = queue_depth
        self._pending.labels(model, version).set_function(lambda: self._queue_depths.get(key, int)())
        self._models[key] = ModelMetrics(self, model, version)
        return self._models[key]

    def forget(self, retired: ModelMetrics) -> None:
        """An unloaded version's labels go with it, unless a reload of the same version has taken them over."""
        retired.retired = True  # an answer delivered after the unload must not bring its labels back
        model, version = key = retired.labels
        if self._models.get(key) is not retired:
            return
        del self._models[key]
        self._queue_depths.pop(key, None)
        for family in self._families:
            try:
                family.remove(model, version)
            except KeyError:  # a child never touched
                pass
        for labels in [labels for labels in self._request_counters if labels[:2] == (model, version)]:
            del self._request_counters[labels]
            self._requests.remove(*labels)

    def request_done(self, model: str, version: str, status: str, protocol: str) -> None:
        labels = (model, version, status, protocol)
        counter = self._request_counters.get(labels)
        if counter is None:
            counter = self._request_counters[labels] = self._requests.labels(*labels)
        counter.inc()

    def unauthenticated(self) -> None:
        self._unauthenticated.inc()


class ModelMetrics:
    """One served version's children of the families."""

    def __init__(self, metrics: Metrics, model: str, version: str):
        self._metrics = metrics
        self.labels = (model, version)
        self.retired = False  # the version was unloaded and its labels removed
        m = metrics
        self._count = m._count.labels(model, version)
        self._exec_count = m._exec_count.labels(model, version)
        self._request_seconds = m._request_seconds.labels(model, version)
        self._queue_seconds = m._queue_seconds.labels(model, version)
        self._compute_seconds = m._compute_seconds.labels(model, version)
        self._batch_size = m._batch_size.labels(model, version)
        self._padding = m._padding.labels(model, version)

    def request_done(
        self, status: str, protocol: str, rows: int = 0, total_s=None, queue_s=None, compute_s=None
    ) -> None:
        if self.retired:
            return
        self._metrics.request_done(*self.labels, status, protocol)
        if status == "OK":
            self._count.inc(rows)
            self._request_seconds.observe(total_s)
            self._queue_seconds.observe(queue_s)
            self._compute_seconds.observe(compute_s)

    def batch_done(self, rows: int, padding_ratio: float = 0.0) -> None:
        self._exec_count.inc()
        self._batch_size.observe(rows)
        self._padding.observe(padding_ratio)


class _SequenceCollector:
    """The live sequences, read when scraped: how many, their cache's bytes, steps, and ends by timeout."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def describe(self):
        return self.collect()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sequences = self._metrics._sequences
        live, cache = (len(sequences.live), sequences.cache_bytes) if sequences is not None else (0, 0)
        steps, timed_out = (sequences.steps_total, sequences.timed_out_total) if sequences is not None else (0, 0)
        yield GaugeMetricFamily("mhaserve_sequences_live", "Sequences whose keys and values the server keeps", live)
        yield GaugeMetricFamily(
            "mhaserve_sequence_cache_bytes", "Bytes of the live sequences' keys and values (in --max-inflight-bytes)",
            cache,
        )  # fmt: skip
        yield CounterMetricFamily("mhaserve_sequence_steps", "Steps of sequences answered", steps)
        yield CounterMetricFamily(
            "mhaserve_sequence_step_runs",
            "Runs of the step graph (steps of several short sequences share one on the CPU)",
            self._metrics.sequence_step_runs,
        )  # fmt: skip
        yield CounterMetricFamily(
            "mhaserve_sequences_timed_out", "Sequences dropped after --sequence-idle-timeout-s idle", timed_out
        )
