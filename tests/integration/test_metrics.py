"""The Prometheus endpoint, scraped after real requests: counts by status, rows, runs, latency histograms."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import Client
from tests.support import SMALL_D_MODEL, rand, scrape

D = SMALL_D_MODEL


def test_metrics_count_requests_rows_runs_and_latency(start_server, small_model_dir):
    server = start_server(small_model_dir, "--warmup-runs", "0", "--max-batch-size", "8")
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


def test_steps_of_sequences_count_as_runs_of_their_model_as_batched_requests_do(start_server, small_model_dir):
    server = start_server(small_model_dir, "--warmup-runs", "0")
    x = rand(1, 6, D)
    with Client(server.url) as client:
        before = client.statistics()
        with client.sequence() as sequence:  # three steps, one after another: a run each
            for rows in (slice(0, 3), slice(3, 4), slice(4, 6)):
                sequence.step(x[:, rows], end=rows.stop == 6)
        after = client.statistics()
    assert after.inference_count - before.inference_count == 3
    assert after.execution_count - before.execution_count == 3
    (one_row,) = [batch for batch in after.batch_stats if batch.batch_size == 1]
    assert one_row.compute_infer.count == 3 and one_row.compute_infer.ns > 0
    m = scrape(server.metrics_url)
    model = (("model", "mha"), ("version", "1"))
    assert m[("mhaserve_inference_exec_count_total", model)] == 3
    assert m[("mhaserve_inference_batch_size_count", model)] == 3
    assert m[("mhaserve_sequence_step_runs_total", ())] == 3


def test_metrics_endpoint_can_be_turned_off(start_server, small_model_dir):
    server = start_server(small_model_dir, "--warmup-runs", "0", "--metrics-port", "-1")
    assert server.metrics_url is None and "metrics=off" in server.log
    with Client(server.url) as client:
        assert np.isfinite(client.infer(rand(1, 2, D)).output).all()


def test_refusals_a_transport_makes_before_the_model_is_known_are_counted(start_server, small_model_dir):
    """A bad header length, a body over the limit, a body that never arrives and an undecodable message, streamed
    or unary, are refused before any model is resolved: counted under empty model labels, by status and
    protocol."""
    import socket
    import urllib.error
    import urllib.request

    from mhaserve.protos.generated import grpc_service_pb2 as pb

    args = ("--warmup-runs", "0", "--max-message-bytes", "100000", "--http-read-timeout-s", "1")
    server = start_server(small_model_dir, *args)
    url = f"{server.http_url}/v2/models/mha/infer"
    for body, headers in ((b"{}", {"Inference-Header-Content-Length": "x"}), (b"x" * 200_000, {})):
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(url, body, headers, method="POST"), timeout=10)
    host, port = server.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        assert connection.recv(4096).startswith(b"HTTP/1.1 504")
    with grpc.insecure_channel(server.url) as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        answers = list(stream(iter([b"\xff\xff not a message"]), timeout=10))
        unary = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer", request_serializer=lambda raw: raw)
        with pytest.raises(grpc.RpcError) as refused:
            unary(b"\xff\xff not a message", timeout=10)
    assert answers[0].error_message.startswith("INVALID_ARGUMENT")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in refused.value.details()
    samples = scrape(server.metrics_url)

    def unresolved(status, protocol):
        labels = (("model", ""), ("protocol", protocol), ("status", status), ("version", ""))
        return samples.get(("mhaserve_inference_request_total", labels), 0)

    assert unresolved("INVALID_ARGUMENT", "http") == 1
    assert unresolved("RESOURCE_EXHAUSTED", "http") == 1
    assert unresolved("DEADLINE_EXCEEDED", "http") == 1
    assert unresolved("INVALID_ARGUMENT", "grpc") == 2
