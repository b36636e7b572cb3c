"""The server's log lines: JSON one object a line when asked (under load and under errors), and the opt-in
access log, one line per inference request whichever transport carried it and however it ended."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest

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


def test_the_log_is_switched_while_the_server_runs_as_tritons_clients_ask_over_grpc_and_http(
    start_server_process, small_model_dir
):
    import time

    import tritonclient.grpc as tritongrpc
    import tritonclient.http as tritonhttp
    from tritonclient.utils import InferenceServerException

    server = start_server_process(small_model_dir, *TEST_SERVER_ARGS)
    over_grpc = tritongrpc.InferenceServerClient(server.url)
    over_http = tritonhttp.InferenceServerClient(server.http_url[len("http://") :])

    def infer(request_id: str) -> None:
        with Client(server.url) as client:
            client.infer(rand(1, 2, SMALL_D_MODEL), request_id=request_id)
        time.sleep(0.3)  # an access line is written once the answer has left

    assert "logging" in over_http.get_server_metadata()["extensions"]
    assert over_http.get_log_settings() == {"log_file": "", "log_info": True, "log_warning": True,
                                            "log_error": True, "log_verbose_level": 0, "log_format": "text",
                                            "access_log": False}  # fmt: skip
    infer("before")
    now = over_grpc.update_log_settings({"access_log": True}, as_json=True)["settings"]
    assert now["log_info"] == {"bool_param": True} and now["access_log"] == {"bool_param": True}
    assert now["log_verbose_level"] == {"uint32_param": 0} and now["log_format"] == {"string_param": "text"}
    infer("after-grpc")
    assert over_http.update_log_settings({"log_format": "json"})["log_format"] == "json"
    infer("as-json")

    refusals = {}
    for refused in ({"log_info": "yes"}, {"log_verbose_level": -1}, {"access_log": False, "log_format": "ISO8601"}):
        with pytest.raises(InferenceServerException) as http_refusal:
            over_http.update_log_settings(refused)
        refusals[next(reversed(refused))] = http_refusal.value.message()
    for refused in ({"log_file": "/var/log/mhaserve.log"}, {"colour": True}):
        with pytest.raises(InferenceServerException) as grpc_refusal:
            over_grpc.update_log_settings(refused)
        assert grpc_refusal.value.status() == "StatusCode.INVALID_ARGUMENT"
        refusals[next(iter(refused))] = grpc_refusal.value.message()
    assert over_http.get_log_settings()["access_log"] is True  # a refused change changes nothing
    back = over_http.update_log_settings({"log_format": "default", "log_verbose_level": 1})  # Triton's name
    assert (back["log_format"], back["log_verbose_level"]) == ("text", 1)
    with Client(server.url) as client, pytest.raises(grpc.RpcError):  # verbose: a refusal says why in the log
        client.infer(rand(1, 2, SMALL_D_MODEL + 1), request_id="refused-verbose")
    infer("ran-verbose")  # and a run says what it ran
    over_http.update_log_settings({"access_log": False, "log_info": False, "log_verbose_level": 0})
    infer("quiet")
    server.stop()
    assert server.stop_line == "(no stop line)"  # an INFO line, and INFO lines are off

    assert "log setting 'log_info' must be true or false, got a string 'yes'" in refusals["log_info"]
    assert (
        "log setting 'log_verbose_level' must be an integer from 0 to 2**32 - 1, got an integer -1"
        in refusals["log_verbose_level"]
    )
    assert "must be one of text, json" in refusals["log_format"] and "'ISO8601'" in refusals["log_format"]
    assert "'log_file' cannot be changed: the server writes its log to stderr" in refusals["log_file"]
    assert "unknown log setting 'colour'" in refusals["colour"]
    debug = [line for line in server.lines if " DEBUG mhaserve.server: " in line]
    assert any("grpc request 'refused-verbose' refused INVALID_ARGUMENT: input 'query'" in line for line in debug), (
        debug
    )
    assert len([line for line in debug if "model 'mha' version 1 ran 1 rows padded to [2, 2]" in line]) == 1, debug
    access = {}
    for line in server.lines:
        for request_id in ("before", "after-grpc", "as-json", "quiet"):
            if f"'{request_id}'" in line or f'"{request_id}"' in line:
                access[request_id] = line
    assert set(access) == {"after-grpc", "as-json"}, access  # logged only while the access log was on
    assert " INFO mhaserve.access: grpc mha/1 OK id='after-grpc'" in access["after-grpc"]
    assert json.loads(access["as-json"])["request_id"] == "as-json"
    changed = [line for line in server.lines if "log settings changed" in line]
    assert len(changed) == 4 and "changed: access_log=True" in changed[0]  # each said while INFO lines are written
    assert "access_log=False, log_info=False, log_verbose_level=0" in changed[3]
