"""HTTP/REST beside gRPC: the same model, data plane, limits and refusals, over the KServe v2 REST protocol
with Triton's binary tensor data extension. Real server processes; tritonclient.http unmodified, and raw
HTTP requests."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mhaserve.client.grpc import Client
from mhaserve.loadtest.checked_load import Reference
from tests.support import SMALL_D_MODEL, SMALL_HEADS, TEST_SERVER_ARGS, rand, scrape
from tests.support.triton import triton_http, triton_infer

D, H = SMALL_D_MODEL, SMALL_HEADS
TOKEN = "http-token"


def call(server, method: str, path: str, body: bytes | None = None, headers=None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(server.http_url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def infer_json(query, outputs=("output",), **extra) -> bytes:
    document = {
        "inputs": [{"name": "query", "shape": list(query.shape), "datatype": "FP32", "data": query.tolist()}],
        "outputs": [{"name": name} for name in outputs],
        **extra,
    }
    return json.dumps(document).encode()


def test_every_endpoint_answers_as_the_protocol_says(server):
    for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/mha/ready", "/v2/models/mha/versions/1/ready"):
        assert call(server, "GET", path)[0] == 200, path
    status, _, body = call(server, "GET", "/v2")
    assert status == 200 and "binary_tensor_data" in json.loads(body)["extensions"]
    for path in ("/v2/models/mha", "/v2/models/mha/versions/1"):
        metadata = json.loads(call(server, "GET", path)[2])
        assert metadata["versions"] == ["1"] and metadata["inputs"][0] == {
            "name": "query", "datatype": "FP32", "shape": [-1, -1, D]
        }  # fmt: skip
        assert metadata["outputs"][1]["shape"] == [-1, -1, -1, -1]
    config = json.loads(call(server, "GET", "/v2/models/mha/config")[2])
    assert config["max_batch_size"] == 0 and config["input"][0]["data_type"] == "TYPE_FP32"
    stats = json.loads(call(server, "GET", "/v2/models/mha/stats")[2])["model_stats"]
    assert [(s["name"], s["version"]) for s in stats] == [("mha", "1")]
    index = json.loads(call(server, "POST", "/v2/repository/index", b"{}")[2])
    assert index == [{"name": "mha", "version": "1", "state": "READY", "reason": ""}]
    assert json.loads(call(server, "POST", "/v2/repository/index", b'{"ready": true}')[2]) == index
    status, _, body = call(server, "POST", "/v2/repository/index", b'{"ready": "yes"}')
    assert status == 400 and json.loads(body)["error"].endswith("'ready' must be true or false, got a JSON string")
    # a single-folder server has no repository to load from
    status, _, body = call(server, "POST", "/v2/repository/models/mha/load", b"")
    assert status == 400 and "--model-repository" in json.loads(body)["error"]
    assert call(server, "GET", "/v2/models/mha/versions/2/ready")[0] == 400  # a model it holds: not ready
    assert call(server, "GET", "/v2/models/gpt/ready")[0] == 404  # a name it does not hold
    assert call(server, "GET", "/v2/nothing")[0] == 404


def test_answers_equal_grpc_and_in_process_onnx_runtime_bit_for_bit(server, small_model_dir):
    query = rand(2, 7, D, seed=3)
    mask = np.random.default_rng(4).random((2, 7)) > 0.3
    mask[:, 0] = True
    reference = Reference(small_model_dir).session
    want_out, want_attn = reference.run(
        ["output", "attn_weights"], query, query, query, mask[:, None, None, :]
    )  # fmt: skip
    with Client(server.url) as client:
        over_grpc = client.infer(query, mask=mask)
    client = triton_http(server)
    for binary in (True, False):
        result = triton_infer(client, query, mask, binary=binary)
        np.testing.assert_array_equal(result.as_numpy("output"), over_grpc.output)
        np.testing.assert_array_equal(result.as_numpy("attn_weights"), over_grpc.attn_weights)
    np.testing.assert_allclose(over_grpc.output, want_out, rtol=0, atol=1e-6)
    np.testing.assert_allclose(over_grpc.attn_weights, want_attn, rtol=0, atol=1e-6)
    # raw JSON: nested data in, flat row-major data out; outputs chosen as on gRPC
    status, headers, body = call(server, "POST", "/v2/models/mha/infer", infer_json(query, id="raw-7"))
    answer = json.loads(body)
    assert status == 200 and headers["Content-Type"].startswith("application/json") and answer["id"] == "raw-7"
    assert [o["name"] for o in answer["outputs"]] == ["output"] and answer["outputs"][0]["shape"] == [2, 7, D]
    unmasked = Client(server.url).infer(query, attn_weights=False).output
    np.testing.assert_array_equal(np.array(answer["outputs"][0]["data"], dtype=np.float32).reshape(2, 7, D), unmasked)


def test_binary_outputs_follow_the_json_header(server):
    query = rand(1, 5, D, seed=5)
    document = {
        "inputs": [
            {"name": "query", "shape": [1, 5, D], "datatype": "FP32", "parameters": {"binary_data_size": query.nbytes}}
        ],
        "outputs": [{"name": "attn_weights_mean", "parameters": {"binary_data": True}}, {"name": "output"}],
    }  # fmt: skip
    header = json.dumps(document).encode()
    status, headers, body = call(
        server, "POST", "/v2/models/mha/infer", header + query.tobytes(),
        {"Inference-Header-Content-Length": str(len(header)), "Content-Type": "application/octet-stream"},
    )  # fmt: skip
    assert status == 200, body
    json_length = int(headers["Inference-Header-Content-Length"])
    answer = json.loads(body[:json_length])
    mean_entry, output_entry = answer["outputs"]
    assert mean_entry["parameters"]["binary_data_size"] == 4 * 5 * 5 and "data" in output_entry
    mean = np.frombuffer(body[json_length:], dtype=np.float32).reshape(1, 5, 5)
    with Client(server.url) as client:
        want = client.infer(query, attn_weights_mean=True)
    np.testing.assert_array_equal(mean, want.attn_weights_mean)


def _raw_infer(server, document=None, body=None, headers=None):
    body = json.dumps(document).encode() if body is None else body
    status, response_headers, text = call(server, "POST", "/v2/models/mha/infer", body, headers)
    return status, response_headers, json.loads(text)["error"] if status != 200 else ""


def tensor(name="query", shape=(1, 2, D), datatype="FP32", data=None, **parameters):
    entry = {"name": name, "shape": list(shape), "datatype": datatype}
    if parameters:
        entry["parameters"] = parameters
    else:
        entry["data"] = np.full(shape, 0.5).tolist() if data is None else data
    return entry


MALFORMED = {
    "wrong d_model": ({"inputs": [tensor(shape=(1, 2, D - 1))]}, 400, ["'query'", f"expected d_model {D}"]),
    "unknown input": ({"inputs": [tensor(), tensor("values")]}, 400, ["'values'", "query, key, value, mask"]),
    "unknown output": ({"inputs": [tensor()], "outputs": [{"name": "weights"}]}, 400, ["'weights'"]),
    "bad datatype": ({"inputs": [tensor(datatype="FP16")]}, 400, ["'query'", "'FP16'", "FP32"]),
    "too few values": ({"inputs": [tensor(data=[0.5] * 7)]}, 400, ["'query'", "7 values", f"expected {2 * D}"]),
    "strings as data": ({"inputs": [tensor(data=["a"] * 2 * D)]}, 400, ["'query'"]),
    "ragged data": ({"inputs": [tensor(data=[[0.5] * D, [0.5]])]}, 400, ["'query'", "ragged"]),
    "no query": ({"inputs": [tensor("key")]}, 400, ["'query' is missing"]),
    "mask shape": ({"inputs": [tensor(), tensor("mask", (1, 3), "BOOL", [[True] * 3])]}, 400, ["'mask'", "[1, 3]"]),
    "int8 out of range": (
        {"inputs": [tensor(), tensor("mask", (1, 2), "INT8", [[1, 300]])]},
        400,
        ["'mask'", "300", "INT8"],
    ),
    "non-finite": ({"inputs": [tensor(shape=(1, 1, D), data=[1e39] * D)]}, 400, ["'query'", "non-finite"]),
    "over max_batch_size": ({"inputs": [tensor(shape=(9, 1, D))]}, 429, ["max_batch_size=8"]),
    "no inputs": ({"id": "x"}, 400, ["'inputs'"]),
    "not an object": ([1, 2], 400, ["JSON array"]),
    "binary size beyond the body": ({"inputs": [tensor(binary_data_size=99999)]}, 400, ["'query'", "binary_data_size"]),
    "negative dimension": ({"inputs": [tensor(shape=(1, -2, D), data=[])]}, 400, ["'query'", "negative"]),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_requests_get_the_status_a_rest_client_expects_naming_the_tensor(server, case):
    document, expected_status, phrases = MALFORMED[case]
    status, headers, message = _raw_infer(server, document)
    assert status == expected_status, (status, message)
    for phrase in phrases:
        assert phrase in message, (phrase, message)
    if status == 429:
        assert headers["Retry-After"] == "1"
    assert triton_http(server).is_server_live()


def test_the_message_text_is_the_grpc_status_message(server):
    import grpc

    with Client(server.url) as client, pytest.raises(grpc.RpcError) as over_grpc:
        client.infer(rand(1, 2, D - 1))
    _, _, over_http = _raw_infer(server, {"inputs": [tensor(shape=(1, 2, D - 1), data=rand(1, 2, D - 1).tolist())]})
    assert over_http == over_grpc.value.details()


def test_bodies_that_are_not_requests(server):
    assert _raw_infer(server, body=b"\xff\x00 not json")[0] == 400
    status, _, message = _raw_infer(server, body=b"{}", headers={"Inference-Header-Content-Length": "99"})
    assert status == 400 and "longer than the body" in message
    status, _, message = call(server, "POST", "/v2/models/gpt/infer", infer_json(rand(1, 2, D)))
    assert status == 404 and "'gpt'" in json.loads(message)["error"]
    assert call(server, "GET", "/v2/models/mha/infer")[0] == 405


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(
    body=st.one_of(st.binary(max_size=300), st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
            ["inputs", "outputs", "name", "shape", "datatype", "data", "parameters", "binary_data_size", "id"]
        ), inner, max_size=5), max_leaves=20).map(lambda v: json.dumps(v).encode())),
    header_length=st.one_of(st.none(), st.integers(-5, 400).map(str), st.text("0123456789 -+ax", max_size=4)),
)  # fmt: skip
def test_fuzzed_bodies_and_headers_get_json_errors_never_a_crash(server, body, header_length):
    headers = {} if header_length is None else {"Inference-Header-Content-Length": header_length}
    try:
        status, _, text = call(server, "POST", "/v2/models/mha/infer", body, headers)
    except ValueError:  # urllib refuses a header value with control characters before sending
        return
    assert status in (200, 400, 429), (status, text)
    if status != 200:
        assert json.loads(text)["error"]


def test_over_the_body_limit_is_413(start_server, small_model_dir):
    server = start_server(small_model_dir, *TEST_SERVER_ARGS, "--max-message-bytes", "100000")
    status, _, body = call(server, "POST", "/v2/models/mha/infer", b"x" * 200_000)
    assert status == 413 and "100000 bytes" in json.loads(body)["error"]


def test_token_on_http_health_open(start_server, small_model_dir, monkeypatch):
    monkeypatch.setenv("MHASERVE_AUTH_TOKEN", TOKEN)
    server = start_server(small_model_dir, *TEST_SERVER_ARGS)
    assert call(server, "GET", "/v2/health/ready")[0] == 200
    status, headers, body = call(server, "POST", "/v2/models/mha/infer", infer_json(rand(1, 2, D)))
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer" and "Bearer" in json.loads(body)["error"]
    assert call(server, "GET", "/v2/models/mha", headers={"Authorization": "Bearer wrong"})[0] == 401
    good = {"Authorization": f"Bearer {TOKEN}"}
    assert call(server, "POST", "/v2/models/mha/infer", infer_json(rand(1, 2, D)), good)[0] == 200
    assert scrape(server.metrics_url)[("mhaserve_unauthenticated_request_total", ())] == 2


def test_a_content_length_shorter_than_the_body_is_refused_without_echoing_the_rest(server):
    host, port = server.http_url.removeprefix("http://").split(":")
    secret = b'{"inputs": "the tail of a body that must not come back"}'
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}" + secret)
        replies = b""
        while chunk := connection.recv(65536):
            replies += chunk
    assert b"must not come back" not in replies
    statuses = [line.split(b" ")[1] for line in replies.split(b"\r\n") if line.startswith(b"HTTP/1.")]
    assert statuses and set(statuses) == {b"400"}, replies
    assert b"not valid HTTP/1.1" in replies and b"check its Content-Length" in replies


def test_a_page_on_an_allowed_origin_may_call_the_api_and_read_its_answers_and_no_other_may(
    start_server, server, small_model_dir, tmp_path
):
    (tmp_path / "tokens").write_text("secret\n")
    page = "https://attention.example:8443"
    cors = start_server(small_model_dir, *TEST_SERVER_ARGS, "--http-cors-origins", f"{page}, http://localhost:3000",
                        "--auth-token-file", str(tmp_path / "tokens"))  # fmt: skip

    def preflight(origin):  # what a browser asks before the call, with no token
        asked = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, inference-header-content-length",
        }
        return call(cors, "OPTIONS", "/v2/models/mha/infer", headers={"Origin": origin, **asked})  # fmt: skip

    status, headers, _ = preflight(page)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == page, headers
    assert "INFERENCE-HEADER-CONTENT-LENGTH" in headers["Access-Control-Allow-Headers"].upper()
    with_token = {"Origin": page, "Authorization": "Bearer secret"}
    status, headers, body = call(cors, "POST", "/v2/models/mha/infer", infer_json(rand(1, 2, D, seed=1)), with_token)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == page
    assert "Inference-Header-Content-Length" in headers["Access-Control-Expose-Headers"]  # binary answers readable
    status, headers, _ = call(cors, "GET", "/v2/models/mha", headers={"Origin": page})  # no token: the page reads why
    assert status == 401 and headers["Access-Control-Allow-Origin"] == page

    for other in ("https://elsewhere.example", "null", "https://attention.example"):
        status, headers, _ = preflight(other)
        assert status == 403 and "Access-Control-Allow-Origin" not in headers, other
        status, headers, _ = call(cors, "GET", "/v2/models/mha", headers={**with_token, "Origin": other})
        assert status == 200 and "Access-Control-Allow-Origin" not in headers  # a browser keeps it from the page
    status, headers, _ = call(server, "GET", "/v2/models/mha", headers={"Origin": page})  # off unless asked for
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


# A page's script calling the API as a web app would: the token in a header it sets, JSON in, the output's shape out
# (or, where the browser keeps the answer from it, the error fetch() rejects with).
FETCH_JS = """
fetch(%(url)s, {method: "POST", headers: {"Authorization": "Bearer secret", "Content-Type": "application/json"},
                body: JSON.stringify(%(request)s)})
  .then((answer) => answer.json()).then((answer) => answer.outputs[0].shape)
  .catch((error) => "refused by the browser: " + error)
"""


def test_a_real_browser_lets_a_page_on_an_allowed_origin_call_the_api_and_keeps_it_from_others(
    start_server, small_model_dir, tmp_path
):
    from aiohttp import web

    from tests.support.browser import CHROMIUM, Browser

    if CHROMIUM is None:
        pytest.skip("needs Chromium (bash tests/tools/install_chromium.sh)")
    (tmp_path / "tokens").write_text("secret\n")
    request = json.loads(infer_json(rand(1, 3, D, seed=2)))

    async def fetched_from(page_port: int, api) -> object:
        async with Browser() as browser:
            script = FETCH_JS % {
                "url": json.dumps(api.http_url + "/v2/models/mha/infer"),
                "request": json.dumps(request),
            }
            return await browser.evaluate(f"http://127.0.0.1:{page_port}/", script)

    async def main():
        async def app_page(_):
            return web.Response(text="<html><body>app</body></html>", content_type="text/html")

        page = web.Application()  # the web app's own origin: a page of its own
        page.router.add_get("/", app_page)
        runner = web.AppRunner(page)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            allowing = start_server(small_model_dir, *TEST_SERVER_ARGS, "--auth-token-file", str(tmp_path / "tokens"),
                                    "--http-cors-origins", f"http://127.0.0.1:{port}")  # fmt: skip
            other = start_server(small_model_dir, *TEST_SERVER_ARGS, "--auth-token-file", str(tmp_path / "tokens"),
                                 "--http-cors-origins", "https://elsewhere.example")  # fmt: skip
            return await fetched_from(port, allowing), await fetched_from(port, other)
        finally:
            await runner.cleanup()

    allowed, kept_from = asyncio.run(main())
    assert allowed == [1, 3, D], allowed
    assert str(kept_from).startswith("refused by the browser: TypeError"), kept_from


def test_a_shape_past_64_bits_is_refused_as_such_not_as_a_rounded_number(server):
    # JSON decoders read an integer past 64 bits as a float: 99999999999999999999 would read 1e20
    for dim in (b"18446744073709551616", b"99999999999999999999"):
        body = b'{"inputs": [{"name": "query", "datatype": "FP32", "shape": [%s, 1, 64], "data": [1]}]}' % dim
        status, _, message = call(server, "POST", "/v2/models/mha/infer", body)
        said = "input 'query': 'shape' has a dimension of 2^63 or more"
        assert status == 400 and json.loads(message)["error"] == said, message


def test_a_client_sending_half_a_body_is_dropped_after_the_read_timeout(start_server, small_model_dir):
    server = start_server(small_model_dir, *TEST_SERVER_ARGS, "--http-read-timeout-s", "1")
    host, port = server.http_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 10)
        started = time.monotonic()
        reply = connection.recv(4096)
        waited = time.monotonic() - started
    assert reply.startswith(b"HTTP/1.1 504") and b"did not arrive within 1 s" in reply
    assert waited < 5
    assert triton_http(server).is_server_ready()


def test_a_client_gone_mid_body_is_counted_cancelled_in_one_log_line(start_server, small_model_dir):
    import struct

    server = start_server(small_model_dir, *TEST_SERVER_ARGS)
    host, port = server.http_url.removeprefix("http://").split(":")

    def cancelled_and_internal() -> tuple[float, float]:
        samples = scrape(server.metrics_url)
        return tuple(
            sum(v for (name, labels), v in samples.items()
                if name == "mhaserve_inference_request_total" and ("status", status) in labels)
            for status in ("CANCELLED", "INTERNAL")
        )  # fmt: skip

    before = cancelled_and_internal()
    for _ in range(3):
        connection = socket.create_connection((host, int(port)), timeout=10)
        connection.sendall(b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{" * 1)
        connection.sendall(b" " * 5000)
        time.sleep(0.2)  # the server is reading the body
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # closed with a reset
        connection.close()
    deadline = time.monotonic() + 5
    while cancelled_and_internal()[0] < before[0] + 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    cancelled, internal = cancelled_and_internal()
    assert (cancelled - before[0], internal - before[1]) == (3, 0)  # the client's doing, not the server's error
    assert "Traceback" not in server.log and "ConnectionResetError" not in server.log
    assert triton_http(server).is_server_ready()


def test_http_and_grpc_requests_share_the_statistics_and_metrics_name_the_protocol(server):
    def ok_by_protocol() -> dict[str, float]:
        samples = scrape(server.metrics_url)
        return {
            dict(labels)["protocol"]: value
            for (name, labels), value in samples.items()
            if name == "mhaserve_inference_request_total" and ("status", "OK") in labels
        }

    before = json.loads(call(server, "GET", "/v2/models/mha/versions/1/stats")[2])["model_stats"][0]
    counted = ok_by_protocol()
    call(server, "POST", "/v2/models/mha/infer", infer_json(rand(1, 2, D)))
    with Client(server.url) as client:
        client.infer(rand(1, 2, D))
        after = client.statistics()
    assert after.inference_count == before["inference_count"] + 2
    now = ok_by_protocol()
    assert now["http"] == counted.get("http", 0) + 1 and now["grpc"] == counted.get("grpc", 0) + 1


def test_an_http_and_a_grpc_request_are_merged_into_one_run(start_server, small_model_dir):
    import threading
    from concurrent.futures import ThreadPoolExecutor

    # The queue waits up to 0.5 s for company, so two requests sent together are certain to share a run.
    args = ("--max-queue-delay-us", "500000", "--warmup-runs", "0")
    server = start_server(small_model_dir, *args)
    with Client(server.url) as client:
        over_http, over_grpc = rand(2, 6, D, seed=21), rand(1, 6, D, seed=22)
        both_sent = threading.Barrier(2)

        def http_call():
            both_sent.wait()
            return triton_infer(triton_http(server), over_http)

        def grpc_call():
            both_sent.wait()
            return client.infer(over_grpc)

        before = client.statistics()
        with ThreadPoolExecutor(2) as pool:
            http_answer, grpc_answer = pool.submit(http_call), pool.submit(grpc_call)
            http_answer, grpc_answer = http_answer.result(60), grpc_answer.result(60)
        after = client.statistics()
        assert after.execution_count == before.execution_count + 1
        assert after.inference_count == before.inference_count + 3  # rows: 2 over HTTP, 1 over gRPC
        assert any(b.batch_size == 3 for b in after.batch_stats)
    reference = Reference(small_model_dir).session  # each request alone, in process
    for query, output, weights in (
        (over_http, http_answer.as_numpy("output"), http_answer.as_numpy("attn_weights")),
        (over_grpc, grpc_answer.output, grpc_answer.attn_weights),
    ):
        no_mask = np.ones((1, 1, 1, 6), bool)
        want_out, want_attn = reference.run(["output", "attn_weights"], query, query, query, no_mask)
        np.testing.assert_allclose(output, want_out, rtol=0, atol=1e-6)
        np.testing.assert_allclose(weights, want_attn, rtol=0, atol=1e-6)


def test_sigterm_drains_http_like_grpc_nothing_accepted_is_lost(start_server_process, small_model_dir):
    from concurrent.futures import ThreadPoolExecutor

    args = ("--max-batch-size", "32", "--max-q-len", "512", "--grace-seconds", "30", "--drain-seconds", "2")
    server = start_server_process(small_model_dir, *args, "--warmup-runs", "0")
    queries = [rand(16, 384, D, seed=i) for i in range(12)]

    def binary_infer(query):
        header = json.dumps({
            "inputs": [{"name": "query", "shape": list(query.shape), "datatype": "FP32",
                        "parameters": {"binary_data_size": query.nbytes}}],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }).encode()  # fmt: skip
        headers = {"Inference-Header-Content-Length": str(len(header))}
        return call(server, "POST", "/v2/models/mha/infer", header + query.tobytes(), headers)

    try:
        with ThreadPoolExecutor(len(queries)) as pool:
            calls = [pool.submit(binary_infer, q) for q in queries]
            time.sleep(0.5)  # every call is on the server now, most still queued
            server.signal()
            time.sleep(0.3)
            ready_status = call(server, "GET", "/v2/health/ready")[0]
            late_status, late_headers, late_body = binary_infer(queries[0][:1])
            results = [c.result(120) for c in calls]
        assert [status for status, _, _ in results] == [200] * len(queries)
        assert ready_status == 503
        assert late_status == 503 and 2 <= int(late_headers["Retry-After"]) <= 3  # once the port has closed
        assert "shutting down" in json.loads(late_body)["error"]
        assert server.wait_exit(60) == 0
        assert f"inference calls by status: OK {len(queries)}, UNAVAILABLE 1; 0 in flight at exit" in server.log
    finally:
        server.stop()


def test_infer_and_bench_over_http_from_the_command_line(server, tmp_path):
    import subprocess
    import sys

    url = server.http_url.removeprefix("http://")
    cli = [sys.executable, "-m", "mhaserve.cli"]
    infer = [*cli, "infer", "--protocol", "http", "--url", url]
    done = subprocess.run([*infer, "--q-len", "5", "--mean-weights", "--save", str(tmp_path / "out.npz")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    saved = np.load(tmp_path / "out.npz")
    with Client(server.url) as client:
        over_grpc = client.infer(saved["query"], attn_weights_mean=True)
    np.testing.assert_array_equal(saved["attn_weights_mean"], over_grpc.attn_weights_mean)
    refused = subprocess.run([*infer, "--model", "gpt"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    assert refused.returncode == 1 and "NOT_FOUND: unknown model 'gpt'" in refused.stderr
    # its output into a pipe whose reader has gone (``| head``): it ends quietly, as a Unix tool does
    into_closed_pipe = subprocess.Popen(infer, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    into_closed_pipe.stdout.close()
    stderr = into_closed_pipe.communicate(timeout=60)[1].decode()
    assert into_closed_pipe.returncode == 141 and stderr == "", stderr
    bench = subprocess.run([*cli, "bench", "--protocol", "http", "--url", url, "--concurrency", "2", "--duration", "1",
                            "--warmup", "0.2", "--processes", "1", "--json", str(tmp_path / "b.json")],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bench.returncode == 0, bench.stderr
    (point,) = json.loads((tmp_path / "b.json").read_text())["points"]
    assert point["requests"] > 0 and point["errors"] == 0
