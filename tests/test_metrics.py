"""The Prometheus endpoint, scraped after real requests: counts by status, rows, runs, latency histograms."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mhaserve.client import Client
from mhaserve.server_process import ServerProcess

from .conftest import SMALL_D_MODEL, rand, scrape

D = SMALL_D_MODEL


def test_metrics_count_requests_rows_runs_and_latency(small_model_dir):
    with ServerProcess(small_model_dir, "--warmup-runs", "0", "--max-batch-size", "8") as server:
        assert server.metrics_url is not None
        with Client(server.url) as client:
            for length in (1, 5, 9):
                client.infer(rand(2, length, D))
            with pytest.raises(grpc.RpcError):
                client.infer(rand(1, 3, D + 1))  # wrong d_model: INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError):
                client.infer(rand(9, 3, D))  # over max batch: RESOURCE_EXHAUSTED
        m = scrape(server.metrics_url)
    model = (("model", "mha"), ("version", "1"))

    def value(name, **labels):
        return m[(name, tuple(sorted((*model, *labels.items()))))]

    assert value("mhaserve_inference_request_total", status="OK", protocol="grpc") == 3
    assert value("mhaserve_inference_request_total", status="INVALID_ARGUMENT", protocol="grpc") == 1
    assert value("mhaserve_inference_request_total", status="RESOURCE_EXHAUSTED", protocol="grpc") == 1
    assert value("mhaserve_inference_count_total") == 6
    assert value("mhaserve_inference_exec_count_total") == 3  # one at a time: nothing to merge
    for histogram in ("request", "queue", "compute_infer"):
        name = f"mhaserve_inference_{histogram}_duration_seconds"
        assert value(name + "_count") == 3
        assert 0 < value(name + "_sum") < 60
        assert value(name + "_bucket", le="+Inf") == 3
    assert value("mhaserve_inference_batch_size_count") == 3
    assert value("mhaserve_inference_batch_size_sum") == 6
    assert value("mhaserve_inference_pending_request_count") == 0


def test_metrics_endpoint_can_be_turned_off(small_model_dir):
    with ServerProcess(small_model_dir, "--warmup-runs", "0", "--metrics-port", "-1") as server:
        assert server.metrics_url is None and "metrics=off" in server.log
        with Client(server.url) as client:
            assert np.isfinite(client.infer(rand(1, 2, D)).output).all()
