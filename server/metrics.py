"""Prometheus metrics (served on their own HTTP port by the process), named after Triton's ``nv_inference_*`` family.

Triton name                          here
nv_inference_request_success/failure mhaserve_inference_request_total{status="OK"|gRPC code, protocol=grpc|http|ray}
(nv_inference_request_failure         mhaserve_inference_request_shed_total{reason=queue_full|queue_timeout|memory|
 {reason="REJECTED"})                 sequences|client_share|receiving}: refused by a bound of the server's, load shed)
nv_inference_count                   mhaserve_inference_count_total (rows inferred)
nv_inference_exec_count              mhaserve_inference_exec_count_total (model runs)
nv_inference_request_duration_us     mhaserve_inference_request_duration_seconds (histogram)
nv_inference_queue_duration_us       mhaserve_inference_queue_duration_seconds (histogram)
nv_inference_compute_infer_duration  mhaserve_inference_compute_infer_duration_seconds (histogram)
nv_inference_pending_request_count   mhaserve_inference_pending_request_count (queue depth)
(batch sizes)                        mhaserve_inference_batch_size (histogram of rows per run)
(memory held by requests)            mhaserve_inference_inflight_bytes (inputs, answers, run workspace)
(its limit)                          mhaserve_inference_inflight_bytes_limit (--max-inflight-bytes)
(requests waiting for that memory)   mhaserve_inference_memory_waiting_request_count
(refused credentials)                mhaserve_unauthenticated_request_total

Durations are in seconds, Prometheus' base unit, rather than Triton's microsecond counters. A request's figures
are plain numbers added to on the event loop and turned into families when scraped (``_ScrapedFigures``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from .errors import SHED_REASONS

# 50 µs .. ~3 s, roughly x2 apart: covers a [1,16,512] run and a long queue under overload.
LATENCY_BUCKETS = (5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PADDING_BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


class Metrics:
    """The process's metric families; each served version gets its labelled children (``for_model``), which
    ``forget`` removes when it is unloaded, so labels name only models that exist (bounded cardinality)."""

    def __init__(
        self,
        inflight_bytes: Callable[[], int] = lambda: 0,
        inflight_limit: int = 0,
        memory_waiting: Callable[[], int] = lambda: 0,
    ):
        self.registry = CollectorRegistry()
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
        Gauge(
            "mhaserve_inference_memory_waiting_request_count",
            "Requests received and waiting for memory of --max-inflight-bytes, before their model's queue",
            registry=self.registry,
        ).set_function(memory_waiting)
        self._unauthenticated = Counter(
            "mhaserve_unauthenticated_request",
            "RPCs refused for a missing or wrong bearer token",
            registry=self.registry,
        )
        self._steps_forwarded = Counter(
            "mhaserve_sequence_steps_forwarded",
            "Steps of sequences this worker received and forwarded to the worker that holds their sequence, by status",
            ["status"],
            registry=self.registry,
        )
        self._sequences = None  # the data plane's Sequences, once watched
        self.sequence_step_runs = 0  # runs of step graphs, each of one or more sequences' steps
        # Requests by (model, version, status, protocol), model and version empty for a request that named no served
        # model; forget() drops an unloaded version's.
        self._requests: dict[tuple[str, str, str, str], _Counted] = {}
        self._shed: dict[tuple[str, str, str], _Counted] = {}  # requests shed, by (model, version, reason)
        self._queue_depths: dict[tuple[str, str], Callable[[], int]] = {}
        self._models: dict[tuple[str, str], ModelMetrics] = {}
        self.registry.register(_ScrapedFigures(self))

    def watch_sequences(self, sequences) -> None:
        self._sequences = sequences

    def step_forwarded(self, status: str) -> None:
        self._steps_forwarded.labels(status).inc()

    def step_runs_made(self, runs: int) -> None:
        self.sequence_step_runs += runs

    def for_model(self, model: str, version: str, queue_depth: Callable[[], int]) -> ModelMetrics:
        key = (model, version)
        self._queue_depths[key] = queue_depth
        self._models[key] = ModelMetrics(self, model, version)
        for reason in SHED_REASONS:  # each from 0, so that rate() sees the first
            self._shed.setdefault((*key, reason), _Counted())
        return self._models[key]

    def forget(self, retired: ModelMetrics) -> None:
        """An unloaded version's labels go with it, unless a reload of the same version has taken them over."""
        retired.retired = True  # an answer delivered after the unload must not bring its labels back
        key = retired.labels
        if self._models.get(key) is not retired:
            return
        del self._models[key]
        self._queue_depths.pop(key, None)
        for counts in (self._requests, self._shed):
            for labels in [labels for labels in counts if labels[:2] == key]:
                del counts[labels]

    def request_done(self, model: str, version: str, status: str, protocol: str, shed_by: str = "") -> None:
        _count(self._requests, (model, version, status, protocol))
        if shed_by:
            _count(self._shed, (model, version, shed_by))

    def unauthenticated(self) -> None:
        self._unauthenticated.inc()


class ModelMetrics:
    """One served version's figures: plain numbers added to on the event loop, with no lock (prometheus_client's
    children took one per increment, 13 a request, and scanned the buckets in Python: 8.4 us a request against
    1.5 here), read by ``_ScrapedFigures`` when scraped."""

    def __init__(self, metrics: Metrics, model: str, version: str):
        self._metrics = metrics
        self.labels = (model, version)
        self.retired = False  # the version was unloaded and its labels removed
        self.rows = _Counted()
        self.runs = _Counted()
        self.request_seconds = _Histogram(LATENCY_BUCKETS)
        self.queue_seconds = _Histogram(LATENCY_BUCKETS)
        self.compute_seconds = _Histogram(LATENCY_BUCKETS)
        self.batch_size = _Histogram(BATCH_BUCKETS)
        self.padding = _Histogram(PADDING_BUCKETS)
        # Live parity (server/parity.py), added to on its own thread: its checks by outcome, each output's error.
        self.parity_checks = {outcome: _Counted() for outcome in PARITY_OUTCOMES}
        self.parity_error = {output: _Histogram(PARITY_ERROR_BUCKETS) for output in PARITY_OUTPUTS}

    def request_done(
        self, status: str, protocol: str, rows: int = 0, total_s=None, queue_s=None, compute_s=None, shed_by: str = ""
    ) -> None:
        if self.retired:
            return
        self._metrics.request_done(*self.labels, status, protocol, shed_by)
        if status == "OK":
            self.rows.value += rows
            self.request_seconds.observe(total_s)
            self.queue_seconds.observe(queue_s)
            self.compute_seconds.observe(compute_s)

    def batch_done(self, rows: int, padding_ratio: float = 0.0) -> None:
        self.runs.value += 1
        self.batch_size.observe(rows)
        self.padding.observe(padding_ratio)


class _Counted:
    """A counter's value and when it began (a Prometheus counter's ``_created``)."""

    __slots__ = ("value", "created")

    def __init__(self):
        self.value = 0
        self.created = time.time()


def _count(counts: dict[tuple, _Counted], labels: tuple) -> None:
    """One more in the counter of ``labels``, made at its first."""
    counted = counts.get(labels)
    if counted is None:
        counted = counts[labels] = _Counted()
    counted.value += 1


class _Histogram:
    """A histogram's count per bucket (not cumulative: one increment an observation), their sum, and when it
    began."""

    __slots__ = ("bounds", "counts", "sum", "created")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self.created = time.time()

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # le: a value on a bound counts in its bucket
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        buckets, total = [], 0
        for bound, count in zip((*map(floatToGoString, self.bounds), "+Inf"), self.counts, strict=True):
            total += count
            buckets.append((bound, float(total)))
        return buckets


LABELS = ("model", "version")
PARITY_OUTCOMES = ("held", "breached", "dropped")
PARITY_OUTPUTS = ("output", "attn_weights")
# An output's error against the exact answer, relative to its largest magnitude (the weights' absolute where the
# export states it so): float32's sit near 1e-7, float16's near 1e-3, the tolerances from 1e-5 to 3e-2.
PARITY_ERROR_BUCKETS = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 4e-3, 1e-2, 3e-2, 1e-1, 1.0)
HISTOGRAMS = (
    ("mhaserve_inference_request_duration_seconds", "Whole request in the server: decode, queue, run, encode",
     "request_seconds"),
    ("mhaserve_inference_queue_duration_seconds", "Time a request waited for a worker", "queue_seconds"),
    ("mhaserve_inference_compute_infer_duration_seconds", "Model run (merge, ONNX Runtime, split) per request",
     "compute_seconds"),
    ("mhaserve_inference_batch_size", "Rows per model run", "batch_size"),
    ("mhaserve_inference_padding_ratio",
     "Share of a model run's query-key pairs that are padding (requests of different lengths in one run)", "padding"),
)  # fmt: skip


class _ScrapedFigures:
    """The families made of the server's own figures when scraped: the requests and runs of each version, and the
    live sequences."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def describe(self):
        return self.collect()

    def collect(self):
        yield from self._requests_and_runs()
        yield from self._sequences()

    def _requests_and_runs(self):
        metrics = self._metrics
        models = list(metrics._models.items())
        requests = CounterMetricFamily(
            "mhaserve_inference_request",
            "Inference requests by final status (OK or the error code) and protocol (grpc or http); model and "
            "version empty for requests that named no served model",
            labels=(*LABELS, "status", "protocol"),
        )
        for labels, counted in list(metrics._requests.items()):
            requests.add_metric(labels, counted.value, created=counted.created)
        yield requests
        shed = CounterMetricFamily(
            "mhaserve_inference_request_shed",
            "Inference requests refused by a bound of the server's, by reason (queue_full, queue_timeout, memory, "
            "sequences, client_share, receiving): load shed, where a refusal of a request over its own limits is the "
            "client's",
            labels=(*LABELS, "reason"),
        )
        for labels, counted in list(metrics._shed.items()):
            shed.add_metric(labels, counted.value, created=counted.created)
        yield shed
        for name, text, figure in (
            ("mhaserve_inference_count", "Rows (batch elements) inferred", "rows"),
            ("mhaserve_inference_exec_count", "Model runs (merged batches, and runs of sequences' steps)", "runs"),
        ):
            family = CounterMetricFamily(name, text, labels=LABELS)
            for labels, model in models:
                counted = getattr(model, figure)
                family.add_metric(labels, counted.value, created=counted.created)
            yield family
        for name, text, figure in HISTOGRAMS:
            family = HistogramMetricFamily(name, text, labels=LABELS)
            for labels, model in models:
                histogram = getattr(model, figure)
                family.add_metric(labels, histogram.cumulative(), histogram.sum)
                created = Sample(f"{name}_created", dict(zip(LABELS, labels, strict=True)), histogram.created)
                family.samples.append(created)
            yield family
        yield from self._parity(models)
        pending = GaugeMetricFamily("mhaserve_inference_pending_request_count", "Requests waiting in the queue",
                                    labels=LABELS)  # fmt: skip
        for labels, depth in list(metrics._queue_depths.items()):
            pending.add_metric(labels, depth())
        yield pending

    def _parity(self, models):
        """Live parity's checks by outcome and each output's error, per version."""
        checks = CounterMetricFamily(
            "mhaserve_parity_checks",
            "Answers recomputed in float64 and compared (--parity-share): held or breached the export's tolerance, "
            "or dropped because the checks were behind",
            labels=(*LABELS, "outcome"),
        )
        errors = HistogramMetricFamily(
            "mhaserve_parity_error",
            "A checked answer's error against the exact answer, relative to its largest magnitude (the weights' "
            "absolute where the export states their tolerance so)",
            labels=(*LABELS, "output"),
        )
        for labels, model in models:
            for outcome, counted in model.parity_checks.items():
                checks.add_metric((*labels, outcome), counted.value, created=counted.created)
            for output, histogram in model.parity_error.items():
                errors.add_metric((*labels, output), histogram.cumulative(), histogram.sum)
        yield checks
        yield errors

    def _sequences(self):
        """How many live, their cache's bytes, steps, and ends by timeout."""
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
