"""What tests share besides fixtures: the small model's size, the reference answer, inputs, metric scrapes."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
# Scripts run as separate client processes (tritonclient, protoc's descriptors), beside the server under test.
CLIENT_SCRIPTS = Path(__file__).resolve().parent / "clients"

SMALL_D_MODEL, SMALL_HEADS = 64, 4


def eager(module, query, key=None, value=None, mask=None):
    """The module's (output, attn_weights) as numpy, for numpy inputs: the reference answer."""
    import torch

    with torch.no_grad():
        out, attn = module(*(None if a is None else torch.from_numpy(np.asarray(a)) for a in (query, key, value, mask)))
    return out.numpy(), attn.numpy()


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """A Prometheus endpoint's samples, {(sample name, sorted labels): value}, from one GET."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def by_worker(server, metric: str, **labels: str) -> dict[str, float]:
    """A server of --workers: a metric's samples with ``labels``, summed per worker (the label each worker's series
    carries)."""
    summed: dict[str, float] = {}
    for (name, sample_labels), value in scrape(server.metrics_url).items():
        sample_labels = dict(sample_labels)
        if name == metric and labels.items() <= sample_labels.items():
            summed[sample_labels["worker"]] = summed.get(sample_labels["worker"], 0.0) + value
    return summed


def worker_that_took(server, start) -> int:
    """A server of --workers: the worker the sequences ``start()`` starts live in (the one its connection reached),
    by the live sequences each worker reports."""
    before = by_worker(server, "mhaserve_sequences_live")
    start()
    after = by_worker(server, "mhaserve_sequences_live")
    (worker,) = [worker for worker, live in after.items() if live > before.get(worker, 0)]
    return int(worker)


def parity_checks(server) -> dict[str, float]:
    """The server's live parity checks by outcome (held, breached, dropped), once the checks queued have been
    made (none pending in any model's statistics, and each made check has observed its outputs' errors), or after
    30 s."""
    import grpc

    from mhaserve.protos.generated import grpc_service_pb2 as pb
    from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

    deadline = time.monotonic() + 30
    with grpc.insecure_channel(server.url) as channel:
        statistics = pb_grpc.GRPCInferenceServiceStub(channel).ModelStatistics
        while True:
            pending = sum(
                model.parity.pending for model in statistics(pb.ModelStatisticsRequest(), timeout=10).model_stats
            )
            samples = scrape(server.metrics_url)
            counted = {dict(labels)["outcome"]: value for (name, labels), value in samples.items()
                       if name == "mhaserve_parity_checks_total"}  # fmt: skip
            errors = sum(value for (name, labels), value in samples.items() if name == "mhaserve_parity_error_count")
            made = errors >= 2 * (counted.get("held", 0) + counted.get("breached", 0))
            if (made and not pending) or time.monotonic() > deadline:
                return counted
            time.sleep(0.1)


def inflight_and_counts(server) -> tuple[float, dict[str, float]]:
    samples = scrape(server.metrics_url)
    counts = {}
    for (name, labels), value in samples.items():
        if name == "mhaserve_inference_request_total" and dict(labels).get("model") == "mha":
            counts[f"{dict(labels)['protocol']} {dict(labels)['status']}"] = value
    return samples[("mhaserve_inference_inflight_bytes", ())], counts


def budget_once_idle(server, timeout: float = 10.0) -> float:
    """The budget's bytes once the server is idle: run workspace stays counted until the arena is given back,
    a couple of seconds after the last request ends."""
    deadline = time.monotonic() + timeout
    while (held := inflight_and_counts(server)[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return held


# Limits small enough that tests can cross them cheaply.
TEST_SERVER_ARGS = ("--max-batch-size", "8", "--max-q-len", "64", "--max-kv-len", "64", "--warmup-runs", "1")


def assert_within_relative(got, want, tolerance=None):
    """Within a relative tolerance (a validate.Bound, float16's by default): the largest error over the
    reference's largest value."""
    from mhaserve.export.validate import TOLERANCES

    tolerance = tolerance or TOLERANCES["fp16"].output
    assert got.shape == want.shape
    error = np.max(np.abs(got.astype(np.float64) - want))
    assert error <= tolerance.max_rel * max(np.max(np.abs(want)), 1e-30), error


def assert_documented(error) -> None:
    """A refusal's message is one the errors reference lists under its kind (docs/hooks/reference.py reads them
    from the code): a message written where the reference cannot see it fails here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "hooks" / "reference.py")
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    templates = reference.error_messages()[error.kind]
    assert any(reference.message_pattern(t).fullmatch(error.message) for t in templates), (
        f"{error.kind.name}: {error.message!r} is not in the errors reference"
    )
