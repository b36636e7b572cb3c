"""The metrics' exposition: the server's own figures read as prometheus_client's families would have read."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mhaserve.server.metrics import BATCH_BUCKETS, LATENCY_BUCKETS, PADDING_BUCKETS, Metrics

# On a bound, between bounds, below the first and past the last.
DURATIONS = (1e-3, 2e-3, 3e-5, 7.5e-4, 0.2, 9.0, 1e-3)
ROWS = (1, 8, 3, 256, 300)
PADDING = (0.0, 0.05, 0.33, 0.9, 0.95)


def samples(text: bytes) -> dict[tuple[str, tuple], float]:
    """Every sample but the ``_created`` ones (when each series began), by name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text.decode())
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


def prometheus_clients_own() -> dict[tuple[str, tuple], float]:
    """The same requests and runs recorded in prometheus_client's own Counter and Histogram."""
    registry = CollectorRegistry()
    labels = ("model", "version")
    requests = Counter("mhaserve_inference_request", "", (*labels, "status", "protocol"), registry=registry)
    rows = Counter("mhaserve_inference_count", "", labels, registry=registry)
    runs = Counter("mhaserve_inference_exec_count", "", labels, registry=registry)
    durations = [
        Histogram(name, "", labels, buckets=LATENCY_BUCKETS, registry=registry)
        for name in (
            "mhaserve_inference_request_duration_seconds",
            "mhaserve_inference_queue_duration_seconds",
            "mhaserve_inference_compute_infer_duration_seconds",
        )
    ]
    batch = Histogram("mhaserve_inference_batch_size", "", labels, buckets=BATCH_BUCKETS, registry=registry)
    padding = Histogram("mhaserve_inference_padding_ratio", "", labels, buckets=PADDING_BUCKETS, registry=registry)
    for seconds in DURATIONS:
        requests.labels("mha", "1", "OK", "grpc").inc()
        rows.labels("mha", "1").inc(2)
        for histogram in durations:
            histogram.labels("mha", "1").observe(seconds)
    requests.labels("mha", "1", "INVALID_ARGUMENT", "http").inc()
    requests.labels("", "", "NOT_FOUND", "grpc").inc()
    for size, ratio in zip(ROWS, PADDING, strict=True):
        runs.labels("mha", "1").inc()
        batch.labels("mha", "1").observe(size)
        padding.labels("mha", "1").observe(ratio)
    return samples(generate_latest(registry))


def test_the_exposition_is_prometheus_clients_own_for_the_same_requests_and_runs():
    metrics = Metrics()
    model = metrics.for_model("mha", "1", lambda: 3)
    for seconds in DURATIONS:
        model.request_done("OK", "grpc", 2, seconds, seconds, seconds)
    model.request_done("INVALID_ARGUMENT", "http")
    metrics.request_done("", "", "NOT_FOUND", "grpc")
    for size, ratio in zip(ROWS, PADDING, strict=True):
        model.batch_done(size, ratio)

    ours = samples(generate_latest(metrics.registry))

    expected = prometheus_clients_own()
    assert {key: ours[key] for key in expected} == expected
    assert ours[("mhaserve_inference_pending_request_count", (("model", "mha"), ("version", "1")))] == 3


def test_an_unloaded_version_leaves_no_series_and_a_late_answer_brings_none_back():
    metrics = Metrics()
    retired = metrics.for_model("mha", "1", lambda: 0)
    retired.request_done("OK", "grpc", 1, 1e-3, 0.0, 1e-3)
    metrics.forget(retired)
    retired.request_done("OK", "grpc", 1, 1e-3, 0.0, 1e-3)  # its answer delivered after the unload

    text = generate_latest(metrics.registry).decode()

    assert 'version="1"' not in text
