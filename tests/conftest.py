"""Shared fixtures: small seeded models and their exports, made once per test session."""

from __future__ import annotations

import time

import numpy as np
import pytest

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


@pytest.fixture(scope="session")
def small_module():
    from mhaserve.model import seeded_module

    return seeded_module(SMALL_D_MODEL, SMALL_HEADS, seed=1)


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory, small_module):
    """A validated export of the small module (the matrix runs in about a second at this size)."""
    from mhaserve.export.model_dir import export_model_dir

    out = tmp_path_factory.mktemp("small") / "mha"
    manifest = export_model_dir(
        small_module, out, source={"kind": "seed", "seed": 1}, validation_seed=0, report=lambda _: None
    )
    assert manifest["valid"], "the fixture model failed validation"
    return out


# Limits small enough that tests can cross them cheaply.
TEST_SERVER_ARGS = ("--max-batch-size", "8", "--max-q-len", "64", "--max-kv-len", "64", "--warmup-runs", "1")


@pytest.fixture(scope="session")
def server(small_model_dir):
    """One real server process on a free 127.0.0.1 port, shared by the tests that only talk to it."""
    from mhaserve.testing.server_process import ServerProcess

    with ServerProcess(small_model_dir, *TEST_SERVER_ARGS) as process:
        yield process
