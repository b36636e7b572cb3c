"""Tracing: the spans a real server exports over OTLP (to a receiver made here from opentelemetry-proto), their
names, attributes, parents and links; sampling by rate, count and the caller's trace; Triton's trace extension
turning it on and off at run time over gRPC and HTTP, behind the token."""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import tritonclient.http as triton_http

from mhaserve.client.grpc import Client
from mhaserve.client.http import HttpClient
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support import SMALL_D_MODEL, TEST_SERVER_ARGS, rand
from tests.support.otlp import OtlpReceiver

SERVER_SPAN = "inference.GRPCInferenceService/ModelInfer"
HTTP_SPAN = "POST /v2/models/{name}/infer"
PHASES = ("decoded", "queued", "run started", "run ended", "encoded")  # the events, in order
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_SPAN = "b7ad6b7169203331"


@pytest.fixture
def receiver(request):
    """An OTLP receiver of the protocol the test is marked with (each protocol is exported to in some test)."""
    receiver = OtlpReceiver(request.node.get_closest_marker("otlp").args[0])
    yield receiver
    receiver.close()


def traced_server(start_server, monkeypatch, model_dir, receiver: OtlpReceiver, *flags: str):
    """A server in process whose OpenTelemetry exporter the OTEL_* variables point at ``receiver`` (read when
    tracing starts); a grace period at its stop, within which it flushes its spans."""
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": receiver.protocol,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        "OTEL_SERVICE_NAME": "attention-under-test",
    }
    for name, value in otel.items():
        monkeypatch.setenv(name, value)
    return start_server(model_dir, *TEST_SERVER_ARGS, "--grace-seconds", "5", *flags)


def infer(client: Client, length: int, seed: int = 0, traceparent: str = ""):
    return client.infer(rand(1, length, SMALL_D_MODEL, seed=seed), timeout=30, traceparent=traceparent)


def trace_setting(url: str, model: str = "", token: str = "", **settings: list[str]) -> dict[str, list[str]]:
    """The TraceSetting RPC: no settings reads them, a setting given [] goes back to its global value/default."""
    request = pb.TraceSettingRequest(model_name=model)
    for name, values in settings.items():
        request.settings[name].value.extend(values)
    with grpc.insecure_channel(url) as channel:
        metadata = (("authorization", f"Bearer {token}"),) if token else None
        answer = pb_grpc.GRPCInferenceServiceStub(channel).TraceSetting(request, metadata=metadata, timeout=10)
    return {name: list(setting.value) for name, setting in answer.settings.items()}


@pytest.mark.otlp("grpc")
def test_every_request_is_a_server_span_with_its_phases_and_every_batched_run_links_the_requests_it_served(
    start_server, monkeypatch, small_model_dir, receiver
):
    server = traced_server(
        start_server, monkeypatch, small_model_dir, receiver, "--trace-config", "mode=opentelemetry",
        "--trace-config", "rate=1", "--max-queue-delay-us", "20000",
    )  # fmt: skip
    lengths = [3 + 3 * i for i in range(16)]  # mixed lengths, sent together: batched across lengths
    all_connected = threading.Barrier(16)

    def call(index: int) -> None:
        with Client(server.url) as client:
            client.wait_ready()  # connected before any sends: a slow connect must not spread the sends out
            all_connected.wait(timeout=30)
            infer(client, lengths[index], seed=index)

    with concurrent.futures.ThreadPoolExecutor(16) as callers:
        list(callers.map(call, range(16)))

    requests = receiver.wait_for(SERVER_SPAN, 16)
    assert sorted(s.attributes["mhaserve.request.query_shape"][1] for s in requests) == lengths
    for span in requests:
        assert span.service == "attention-under-test"
        assert span.kind == 2  # SERVER
        assert span.attributes["rpc.system"] == "grpc"
        assert span.attributes["rpc.service"] == "inference.GRPCInferenceService"
        assert span.attributes["rpc.method"] == "ModelInfer"
        assert span.attributes["rpc.grpc.status_code"] == 0
        assert span.attributes["mhaserve.model.name"] == "mha" and span.attributes["mhaserve.model.version"] == "1"
        assert span.attributes["mhaserve.status"] == "OK"
        assert span.parent_id == ""  # no caller's trace: a root
    for request in requests:
        events = request.events
        assert [name for name, _, _ in events] == list(PHASES)
        times = [request.start_ns] + [at for _, at, _ in events] + [request.end_ns]
        assert times == sorted(times), events  # each phase after the one before, all within the span
        attributes = request.attributes
        for phase in ("decode", "queue", "infer", "encode", "send"):
            assert attributes[f"mhaserve.{phase}_ms"] >= 0, phase
        assert attributes["mhaserve.infer_ms"] * 1e6 == pytest.approx(events[3][1] - events[2][1], abs=1000)
        assert attributes["mhaserve.response.bytes"] > 0
    by_id = {s.span_id: s for s in requests}

    runs = receiver.named("model run")
    linked = [link for run in runs for link in run.links]
    assert sorted(linked) == sorted((s.trace_id, s.span_id) for s in requests)  # each request in exactly one run
    assert any(len(run.links) > 1 for run in runs), "16 requests sent together were never batched"
    for run in runs:
        assert run.parent_id == ""
        assert run.attributes["mhaserve.batch.requests"] == len(run.links)
        q_lens = run.attributes["mhaserve.batch.q_lens"]
        assert run.attributes["mhaserve.batch.q_len"] == max(q_lens)
        assert 0.0 <= run.attributes["mhaserve.batch.padding_ratio"] < 1.0
        assert (run.attributes["mhaserve.batch.padding_ratio"] > 0) == (len(set(q_lens)) > 1)
        served = [by_id[span_id] for _, span_id in run.links]
        assert sorted(s.attributes["mhaserve.request.query_shape"][1] for s in served) == sorted(q_lens)
        for request in served:  # the run its events name is this run
            run_started, run_ended = request.events[2], request.events[3]
            assert run_started[2]["mhaserve.batch.rows"] == run.attributes["mhaserve.batch.rows"]
            assert abs(run_started[1] - run.start_ns) < 1000 and abs(run_ended[1] - run.end_ns) < 1000


@pytest.mark.otlp("http/protobuf")
def test_a_callers_trace_context_is_the_parent_over_grpc_and_http_and_refusals_carry_their_status(
    start_server, monkeypatch, small_model_dir, receiver
):
    server = traced_server(start_server, monkeypatch, small_model_dir, receiver, "--trace-config",
                           "mode=opentelemetry", "--trace-config", "rate=1", "--log-format", "json", "--access-log",
                           "true")  # fmt: skip
    traceparent = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
    with Client(server.url) as client:
        infer(client, 4, traceparent=traceparent)
        with pytest.raises(grpc.RpcError) as refused:
            client.infer(rand(1, 4, SMALL_D_MODEL + 1))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with HttpClient(server.http_url.removeprefix("http://")) as client:
        client.infer(rand(1, 5, SMALL_D_MODEL), traceparent=traceparent, request_id="over-http")

    grpc_spans = receiver.wait_for(SERVER_SPAN, 2)
    child = next(s for s in grpc_spans if s.attributes["mhaserve.status"] == "OK")
    assert (child.trace_id, child.parent_id) == (CALLER_TRACE, CALLER_SPAN)
    refused = next(s for s in grpc_spans if s.attributes["mhaserve.status"] != "OK")
    assert refused.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert refused.trace_id != CALLER_TRACE

    (http_span,) = receiver.wait_for(HTTP_SPAN, 1)
    assert (http_span.trace_id, http_span.parent_id) == (CALLER_TRACE, CALLER_SPAN)
    assert http_span.attributes["http.request.method"] == "POST"
    assert http_span.attributes["http.route"] == "/v2/models/{name}/infer"
    assert http_span.attributes["http.response.status_code"] == 200
    assert http_span.attributes["mhaserve.request.id"] == "over-http"

    # The access log names the trace each request's spans belong to.
    server.stop()
    access = [json.loads(line) for line in server.lines if '"mhaserve.access"' in line]
    by_protocol = {entry["protocol"]: entry for entry in access if entry["status"] == "OK"}
    assert by_protocol["grpc"]["trace_id"] == CALLER_TRACE and by_protocol["http"]["trace_id"] == CALLER_TRACE


def test_rate_and_count_sample_requests_and_a_sampled_caller_is_traced_at_rate_zero(
    start_server, monkeypatch, small_model_dir
):
    receiver = OtlpReceiver("grpc")
    try:
        server = traced_server(start_server, monkeypatch, small_model_dir, receiver, "--trace-config",
                               "mode=opentelemetry", "--trace-config", "rate=3")  # fmt: skip
        with Client(server.url) as client:
            for index in range(9):
                infer(client, 4 + index)
            assert len(receiver.wait_for(SERVER_SPAN, 3)) == 3
            traced = sorted(s.attributes["mhaserve.request.query_shape"][1] for s in receiver.named(SERVER_SPAN))
            assert traced == [4, 7, 10]  # the first of every three

            assert trace_setting(server.url, trace_rate=["0"])["trace_rate"] == ["0"]
            for _ in range(5):
                infer(client, 4)
            infer(client, 30, traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-01")
            infer(client, 31, traceparent=f"00-{CALLER_TRACE}-{CALLER_SPAN}-00")  # the caller did not sample it
            spans = receiver.wait_for(SERVER_SPAN, 4)
            assert spans[-1].attributes["mhaserve.request.query_shape"][1] == 30

            assert trace_setting(server.url, trace_rate=["1"], trace_count=["2"])["trace_count"] == ["2"]
            for _ in range(6):
                infer(client, 5)
            receiver.wait_for(SERVER_SPAN, 6)
            settings = trace_setting(server.url)
            assert settings["trace_count"] == ["0"] and settings["trace_level"] == ["TIMESTAMPS"]
        server.stop()
        assert len(receiver.named(SERVER_SPAN)) == 6  # two more, then none
    finally:
        receiver.close()


def test_trace_settings_turn_tracing_on_and_off_at_run_time_globally_and_per_model(
    start_server, monkeypatch, small_model_dir
):
    receiver = OtlpReceiver("http/protobuf")
    try:
        server = traced_server(start_server, monkeypatch, small_model_dir, receiver)  # tracing off at start
        with triton_http.InferenceServerClient(server.http_url.removeprefix("http://")) as http_client:
            assert "trace" in http_client.get_server_metadata()["extensions"]
            assert http_client.get_trace_settings() == {
                "trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1", "trace_mode": "opentelemetry",
                "trace_file": "", "log_frequency": "0",
            }  # fmt: skip
            with Client(server.url) as client:
                infer(client, 4)
                updated = http_client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"], "trace_rate": 1})
                assert updated["trace_level"] == ["TIMESTAMPS"] and updated["trace_rate"] == "1"
                infer(client, 5)
                receiver.wait_for(SERVER_SPAN, 1)

                # One model off, the rest (globally) on; then the model follows the global setting again.
                model = http_client.update_trace_settings("mha", settings={"trace_level": ["OFF"]})
                assert model["trace_level"] == ["OFF"] and model["trace_rate"] == "1"
                assert http_client.get_trace_settings()["trace_level"] == ["TIMESTAMPS"]
                infer(client, 6)
                assert trace_setting(server.url, "mha", trace_level=[])["trace_level"] == ["TIMESTAMPS"]
                assert http_client.get_trace_settings("mha")["trace_level"] == ["TIMESTAMPS"]
                infer(client, 7)
                http_client.update_trace_settings(settings={"trace_level": ["OFF"]})
                infer(client, 8)
        server.stop()
        traced = sorted(s.attributes["mhaserve.request.query_shape"][1] for s in receiver.named(SERVER_SPAN))
        assert traced == [5, 7]
    finally:
        receiver.close()


def test_bad_trace_settings_are_refused_naming_the_setting_and_the_token_guards_them(start_server, small_model_dir,
                                                                                     tmp_path):  # fmt: skip
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token-for-tracing\n")
    server = start_server(small_model_dir, *TEST_SERVER_ARGS, "--auth-token-file", str(token_file))
    token = "s3cret-token-for-tracing"
    with pytest.raises(grpc.RpcError) as refused:
        trace_setting(server.url)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for settings, words in (
        ({"trace_level": ["LOUD"]}, "trace_level: expected OFF or TIMESTAMPS, got ['LOUD']"),
        ({"trace_rate": ["often"]}, "trace_rate: expected an integer, got 'often'"),
        ({"trace_count": ["-5"]}, "trace_count: expected -1 (no end) or 0..2147483647, got -5"),
        ({"trace_file": ["/tmp/t.json"]}, "trace_file: trace files are not written here"),
        ({"trace_colour": ["red"]}, "unknown trace setting 'trace_colour'"),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            trace_setting(server.url, token=token, **settings)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        trace_setting(server.url, "nope", token=token)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "unknown model 'nope'" in refused.value.details()
    assert trace_setting(server.url, token=token)["trace_level"] == ["OFF"]

    def post(path: str, body: bytes, headers: dict) -> tuple[int, dict]:
        request = urllib.request.Request(server.http_url + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    assert post("/v2/trace/setting", b'{"trace_level": ["TIMESTAMPS"]}', {})[0] == 401
    bearer = {"Authorization": "Bearer s3cret-token-for-tracing"}
    status, answer = post("/v2/trace/setting", b'{"trace_rate": {"every": 2}}', bearer)
    assert status == 400 and "trace setting 'trace_rate'" in answer["error"]
    status, answer = post("/v2/models/nope/trace/setting", b"{}", bearer)
    assert status == 404 and "unknown model 'nope'" in answer["error"]


def test_trace_config_mistakes_are_one_line_and_exit_2(small_model_dir):
    for flags, words in (
        (["--trace-config", "mode=triton"], "--trace-config: mode=triton: this server traces with OpenTelemetry only"),
        (["--trace-config", "rate=fast"], "--trace-config: trace_rate: expected an integer, got 'fast'"),
        (["--trace-config", "colour=red"], "--trace-config: unknown setting(s) ['colour']"),
    ):
        done = subprocess.run(
            [sys.executable, "-m", "mhaserve.cli", "serve", "--model-dir", str(small_model_dir), *flags],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, done.stderr
        assert words in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_with_tracing_off_the_server_never_imports_opentelemetry(small_model_dir):
    script = f"""
import sys
from pathlib import Path
from mhaserve.server.config import ServerSettings
from mhaserve.server.dataplane import DataPlane
from mhaserve.server import app, tracing  # every module a serving process imports
plane = DataPlane(ServerSettings(), Path({str(small_model_dir)!r}))
assert not plane.tracing.active
print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_sigterm_with_an_otlp_endpoint_that_never_answers_exits_within_the_grace_period(
    start_server_process, small_model_dir, protocol
):
    import signal
    import socket
    import time

    silent = socket.socket()  # accepts connections into its backlog and never reads a byte
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    try:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{silent.getsockname()[1]}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
            "OTEL_BSP_SCHEDULE_DELAY": "50",
        }
        grace = 3.0
        server = start_server_process(
            small_model_dir, *TEST_SERVER_ARGS, "--trace-config", "mode=opentelemetry", "--trace-config", "rate=1",
            "--trace-config", "level=TIMESTAMPS", "--grace-seconds", str(grace), env=env,
        )  # fmt: skip
        with Client(server.url) as client:
            for seed in range(20):  # spans queued for an endpoint that will not take them
                infer(client, 4, seed)
        time.sleep(0.5)  # the exporter is now waiting on the silent endpoint
        stopped = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.wait_exit(grace + 20) == 0, server.log
        took = time.monotonic() - stopped
    finally:
        silent.close()
    assert took <= grace + 2, f"exited {took:.1f} s after SIGTERM, grace {grace} s"
    assert "stopped: inference calls by status: OK 20" in server.log, server.log
