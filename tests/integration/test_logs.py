"""The server's log lines: JSON one object a line when asked (under load and under errors), and the opt-in
access log, one line per inference request whichever transport carried it and however it ended."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc

from mhaserve.client.grpc import Client
from tests.support import SMALL_D_MODEL, TEST_SERVER_ARGS, rand


def http_infer(http_url: str, body: dict) -> int:
    request = urllib.request.Request(
        http_url + "/v2/models/mha/infer", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            answer.read()
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def traffic(server) -> dict[str, int]:
    """16 concurrent gRPC requests with ids, 4 refused ones, and 2 HTTP ones (one refused): what was sent."""
    statuses: list[str] = []

    def caller(index: int) -> None:
        with Client(server.url) as client:
            for round_number in range(2):
                answer = client.infer(
                    rand(1, 4 + index, SMALL_D_MODEL, seed=index), request_id=f"r{index}-{round_number}"
                )
                assert answer.output.shape == (1, 4 + index, SMALL_D_MODEL)
                statuses.append("OK")

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    with Client(server.url) as client:
        for _ in range(4):
            try:
                client.infer(rand(1, 4, SMALL_D_MODEL + 1), request_id="wrong-width")
            except grpc.RpcError as error:
                statuses.append(error.code().name)
    query = rand(1, 3, SMALL_D_MODEL)
    inputs = [{"name": "query", "shape": [1, 3, SMALL_D_MODEL], "datatype": "FP32", "data": query.ravel().tolist()}]
    assert http_infer(server.http_url, {"id": "over-http", "inputs": inputs}) == 200
    assert http_infer(server.http_url, {"id": "bad-http", "inputs": [{**inputs[0], "shape": [1, 3]}]}) == 400
    return {"grpc OK": statuses.count("OK"), "grpc INVALID_ARGUMENT": statuses.count("INVALID_ARGUMENT")}


def test_json_logs_parse_line_by_line_and_the_access_log_has_a_line_per_request(start_server_process, small_model_dir):
    server = start_server_process(small_model_dir, *TEST_SERVER_ARGS, "--log-format", "json", "--access-log", "true")
    sent = traffic(server)
    server.stop()
    entries = [json.loads(line) for line in server.lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= entry.keys() for entry in entries)
    loaded = next(e for e in entries if e["message"].startswith("loaded model="))
    assert loaded["model"] == "mha" and loaded["version"] == "1" and loaded["logger"] == "mhaserve.server"
    access = [e for e in entries if e["logger"] == "mhaserve.access"]
    assert len(access) == sent["grpc OK"] + sent["grpc INVALID_ARGUMENT"] + 2 == 22
    by_id = {e["request_id"]: e for e in access}
    ok = by_id["r3-1"]
    assert (ok["protocol"], ok["model"], ok["version"], ok["status"], ok["rows"]) == ("grpc", "mha", "1", "OK", 1)
    assert ok["bytes_in"] > 7 * SMALL_D_MODEL * 4 and ok["bytes_out"] > 7 * SMALL_D_MODEL * 4
    assert ok["total_ms"] >= ok["compute_ms"] > 0 and ok["queue_ms"] >= 0
    refused = [e for e in access if e["status"] == "INVALID_ARGUMENT"]
    assert len(refused) == 5 and all(e["bytes_out"] == 0 for e in refused)
    assert by_id["over-http"]["protocol"] == "http" and by_id["over-http"]["status"] == "OK"


def test_the_access_log_is_off_unless_asked_and_text_by_default(server, start_server, small_model_dir):
    # The shared server process runs with the defaults: text lines on stderr, no access log.
    with Client(server.url) as client:
        client.infer(rand(1, 4, SMALL_D_MODEL), request_id="abc")
    serving = next(line for line in server.lines if "serving model=" in line)
    assert " INFO mhaserve.server: serving model=" in serving and not serving.lstrip().startswith("{")
    assert not any("mhaserve.access" in line for line in server.lines)
    loud = start_server(small_model_dir, *TEST_SERVER_ARGS, "--access-log", "true")
    with Client(loud.url) as client:
        client.infer(rand(1, 4, SMALL_D_MODEL), request_id="abc")
    loud.stop()
    (line,) = [line for line in loud.lines if "mhaserve.access" in line]
    assert "INFO mhaserve.access: grpc mha/1 OK id='abc' caller='-' peer=ipv" in line and "total_ms=" in line


def test_the_access_log_names_each_caller_by_its_token_s_holder_never_by_the_token(start_server, small_model_dir,
                                                                                   tmp_path):  # fmt: skip
    (tmp_path / "tokens").write_text("alice alice-secret-token\nbob bob-secret-token\n")
    server = start_server(small_model_dir, *TEST_SERVER_ARGS, "--access-log", "true", "--log-format", "json",
                          "--auth-token-file", str(tmp_path / "tokens"))  # fmt: skip
    with Client(server.url, token="alice-secret-token") as client:
        client.infer(rand(1, 2, SMALL_D_MODEL), request_id="from-alice")
    request = urllib.request.Request(
        server.http_url + "/v2/models/mha/infer",
        data=json.dumps({"id": "from-bob", "inputs": [
            {"name": "query", "shape": [1, 1, SMALL_D_MODEL], "datatype": "FP32", "data": [0.5] * SMALL_D_MODEL}
        ]}).encode(),
        headers={"Content-Type": "application/json", "Authorization": "Bearer bob-secret-token"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=30) as answer:
        assert answer.status == 200
    server.stop()
    entries = [json.loads(line) for line in server.lines if line.lstrip().startswith("{")]
    access = {e["request_id"]: e for e in entries if e["logger"] == "mhaserve.access"}
    assert access["from-alice"]["caller"] == "token alice" and access["from-bob"]["caller"] == "token bob"
    assert access["from-alice"]["peer"].startswith("ipv4:127.0.0.1:") and "127.0.0.1" in access["from-bob"]["peer"]
    assert not any("secret-token" in line for line in server.lines)


def test_a_bad_log_format_is_one_line_and_exit_code_2(small_model_dir, capsys):
    from mhaserve.cli import main as cli

    # the command's own main: refused before the server starts, or logging is set up
    assert cli(["serve", "--model-dir", str(small_model_dir), "--log-format", "xml"]) == 2
    stderr = capsys.readouterr().err
    assert "--log-format must be text or json, got 'xml'" in stderr and stderr.strip().count("\n") == 0, stderr
