"""A configuration per model: a model's config.pbtxt (Triton's text format, beside its versions) sets how that
model batches and runs, the server's flags the defaults for models that say nothing and the ceilings for what
one may ask; a file that cannot be served as written keeps its version out with the reason; a changed file
reloads the model in poll mode. Real in-process servers, the project's gRPC client and tritonclient's."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import tritonclient.grpc as tritongrpc

from mhaserve.client.grpc import NO_RETRIES, Client
from tests.integration.test_model_repository import (
    add_version,
    control_over_http,
    index,
    refused,
    repository_server,
)
from tests.support import SMALL_D_MODEL, eager, rand

CONFIGURED = """
max_batch_size: 4
dynamic_batching { max_queue_delay_microseconds: 500 default_queue_policy {
    max_queue_size: 16 default_timeout_microseconds: 250000 allow_timeout_override: true } }
parameters { key: "length_aware_batching" value { string_value: "false" } }
parameters { key: "max_q_len" value { string_value: "32" } }
"""


def served_with(url: str, model: str) -> dict[str, str]:
    """How the server says it serves ``model``: its ModelConfig's parameters, as tritonclient reads them."""
    config = tritongrpc.InferenceServerClient(url).get_model_config(model, as_json=True)["config"]
    return {key: value["string_value"] for key, value in config["parameters"].items()}


def test_each_model_is_served_as_its_config_says_and_the_others_as_the_flags_say(tmp_path, small_model_dir,
                                                                                small_module):  # fmt: skip
    repository = tmp_path / "repository"
    add_version(repository, "configured", 1, small_model_dir)
    add_version(repository, "plain", 1, small_model_dir)
    (repository / "configured" / "config.pbtxt").write_text(CONFIGURED)
    with repository_server(repository, "--max-batch-size", "16") as server:
        configured, plain = served_with(server.url, "configured"), served_with(server.url, "plain")
        query = rand(8, 3, SMALL_D_MODEL, seed=2)
        with Client(server.url, model="configured", retry=NO_RETRIES) as client:
            with pytest.raises(grpc.RpcError) as refused_batch:
                client.infer(query)
            four = client.infer(query[:4])
            with pytest.raises(grpc.RpcError) as refused_length:
                client.infer(rand(1, 33, SMALL_D_MODEL))
        with Client(server.url, model="plain", retry=NO_RETRIES) as client:
            eight = client.infer(query)
    assert (configured["max_batch_size"], configured["max_queue_delay_us"], configured["max_queue_size"]) == (
        "4", "500", "16"
    )  # fmt: skip
    assert configured["length_aware_batching"] == "false" and configured["dynamic_batching"] == "true"
    assert (configured["queue_timeout_us"], configured["allow_timeout_override"]) == ("250000", "true")
    assert (plain["queue_timeout_us"], plain["allow_timeout_override"]) == ("0", "false")
    assert configured["model_config"] == str(repository / "configured" / "config.pbtxt")
    assert (plain["max_batch_size"], plain["max_queue_delay_us"], plain["model_config"]) == ("16", "0", "none")
    assert plain["length_aware_batching"] == "true"
    # the model's own cap refuses a batch of 8, naming the file that set it; the other model takes it
    assert refused_batch.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_batch_size=4 (set by " in refused_batch.value.details()
    assert "configured/config.pbtxt" in refused_batch.value.details()
    assert "max_q_len=32 (set by " in refused_length.value.details()
    assert (configured["max_q_len"], plain["max_q_len"]) == ("32", "64")  # the test servers' --max-q-len 64
    np.testing.assert_allclose(four.output, eager(small_module, query[:4])[0], atol=1e-5)
    np.testing.assert_allclose(eight.output, eager(small_module, query)[0], atol=1e-5)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("max_batch_size: 64", "max_batch_size 64 is above the server's --max-batch-size 8"),
        ("instance_group [ { count: 3 } ]", "inference_workers 3 is above the server's --inference-workers 1"),
        ('parameters { key: "warp_drive" value { string_value: "on" } }', "parameter 'warp_drive' is not a setting"),
        ('parameters { key: "dynamic_batching" value { string_value: "yes" } }', "expected true or false"),
        ("dynamic_batching { max_queue_delay_microseconds: -5 }", "not a model configuration"),
        ("max_batch_size: [", "not a model configuration in Triton's text format"),
        (
            "dynamic_batching { default_queue_policy { timeout_action: DELAY } }",
            "timeout_action DELAY is not supported",
        ),
    ],
)
def test_a_config_that_cannot_be_served_as_written_keeps_its_model_out_and_says_why(
    tmp_path, small_model_dir, text, says
):
    repository = tmp_path / "repository"
    add_version(repository, "broken", 1, small_model_dir)
    add_version(repository, "fine", 1, small_model_dir)
    (repository / "broken" / "config.pbtxt").write_text(text)
    with repository_server(repository, "--exit-on-error", "false") as server:
        rows = index(server)
        with Client(server.url, model="fine") as client:
            client.infer(rand(1, 2, SMALL_D_MODEL))
    assert refused(rows, "broken", "1")
    state, reason = rows[("broken", "1")]
    assert "config.pbtxt" in reason and says in reason, reason
    assert rows[("fine", "1")] == ("READY", "")


def test_a_changed_config_reloads_the_model_in_poll_mode(tmp_path, small_model_dir):
    repository = tmp_path / "repository"
    add_version(repository, "a", 1, small_model_dir)
    server_args = ("--model-control-mode", "poll", "--repository-poll-secs", "0.2")
    with repository_server(repository, *server_args) as server:
        assert served_with(server.url, "a")["max_batch_size"] == "8"
        (repository / "a" / "config.pbtxt").write_text("max_batch_size: 2")
        deadline = time.monotonic() + 15
        while served_with(server.url, "a")["max_batch_size"] != "2" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert served_with(server.url, "a")["max_batch_size"] == "2"


def test_a_model_s_config_chooses_its_versions_and_an_edited_policy_loads_and_unloads_them(tmp_path, small_model_dir):
    repository = tmp_path / "repository"
    for name in ("chosen", "plain"):
        for number in (1, 2, 3):
            add_version(repository, name, number, small_model_dir)
    config = repository / "chosen" / "config.pbtxt"
    config.write_text("version_policy { specific { versions: [1, 3] } }")
    ready = ("READY", "")

    def states_within(expected: dict, seconds: float = 30) -> dict:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            states = {key: state for key, (state, _) in index(server).items()}
            if all(states.get(key) == state for key, state in expected.items()):
                break
            time.sleep(0.1)
        return states

    def policy(model: str) -> dict:
        config = tritongrpc.InferenceServerClient(server.url).get_model_config(model, as_json=True)["config"]
        return config["version_policy"]

    # The server's flag: the newest version of each model; "chosen" says which of its own serve.
    with repository_server(repository, "--model-control-mode", "poll", "--repository-poll-secs", "0.2") as server:
        started = index(server)
        policies = policy("chosen"), policy("plain")
        config.write_text("version_policy { latest { num_versions: 2 } }")
        edited = states_within({("chosen", "1"): "UNAVAILABLE", ("chosen", "2"): "READY"})
        config.write_text("version_policy { all { } }")
        all_of_them = states_within({("chosen", "1"): "READY"})
    assert started[("chosen", "1")] == ready and started[("chosen", "3")] == ready
    assert started[("chosen", "2")] == ("UNAVAILABLE", "not loaded")
    assert [started[("plain", n)][0] for n in "123"] == ["UNAVAILABLE", "UNAVAILABLE", "READY"]
    assert policies == ({"specific": {"versions": ["1", "3"]}}, {"latest": {"num_versions": 1}})
    assert [edited[("chosen", n)] for n in "123"] == ["UNAVAILABLE", "READY", "READY"]
    assert [all_of_them[("chosen", n)] for n in "123"] == ["READY"] * 3
    assert [all_of_them[("plain", n)] for n in "123"] == ["UNAVAILABLE", "UNAVAILABLE", "READY"]


def test_a_load_with_a_config_serves_it_in_place_of_the_file_until_a_load_without_one(tmp_path, small_model_dir):
    import json

    from tritonclient.utils import InferenceServerException

    repository = tmp_path / "repository"
    for number in (1, 2):
        add_version(repository, "a", number, small_model_dir)
    (repository / "a" / "config.pbtxt").write_text("max_batch_size: 4")

    def load_over_http(parameters: dict) -> tuple[int, str]:
        return control_over_http(server, "load", "a", parameters)

    def refusal(call) -> tuple[str, str]:
        try:
            call()
        except InferenceServerException as error:
            return error.status(), error.message()
        raise AssertionError("not refused")

    with repository_server(repository, "--model-control-mode", "explicit", "--load-model", "a") as server:
        triton = tritongrpc.InferenceServerClient(server.url)
        from_file = served_with(server.url, "a"), index(server)
        triton.load_model("a", config=json.dumps({"max_batch_size": 2, "version_policy": {"all": {}}}))
        given = served_with(server.url, "a"), index(server)
        with Client(server.url, model="a", retry=NO_RETRIES) as client:
            with pytest.raises(grpc.RpcError) as too_many_rows:
                client.infer(rand(3, 2, SMALL_D_MODEL))
        bad = refusal(lambda: triton.load_model("a", config='{"max_batch_size": -1}'))
        not_json = load_over_http({"config": "max_batch_size: 3"})
        files = load_over_http({"config": "{}", "file:1/model.onnx": "AAAA"})
        outside = refusal(lambda: triton.load_model("../a", config="{}"))
        deep = load_over_http({"config": '{"parameters": ' + '{"x": ' * 5000 + "1" + "}" * 5001})
        after_refusals = served_with(server.url, "a")
        over_http = load_over_http({"config": '{"max_batch_size": 3}'}), served_with(server.url, "a"), index(server)
        triton.load_model("a")
        back = served_with(server.url, "a"), index(server)
    assert from_file[0]["max_batch_size"] == "4" and from_file[1][("a", "1")][0] == "UNAVAILABLE"
    assert (given[0]["max_batch_size"], given[0]["model_config"]) == ("2", "the load request's config")
    assert given[1][("a", "1")] == ("READY", "") and given[1][("a", "2")] == ("READY", "")
    assert "max_batch_size=2 (set by the load request's config)" in too_many_rows.value.details()
    assert bad == ("StatusCode.INVALID_ARGUMENT",
                   "model 'a': the load request's config: max_batch_size must be at least 1, got -1")  # fmt: skip
    assert not_json[0] == 400 and "not a model configuration in Triton's JSON" in not_json[1]
    assert files[0] == 400 and "load parameters ['file:1/model.onnx'] are not supported: only 'config'" in files[1]
    assert outside[0] == "StatusCode.INVALID_ARGUMENT" and "is not allowed" in outside[1], outside
    assert deep == (400, "model 'a': the load request's config: nested deeper than a model configuration is")
    assert after_refusals["max_batch_size"] == "2"  # nothing refused was done
    assert over_http[0] == (200, "") and over_http[1]["max_batch_size"] == "3"
    assert over_http[2][("a", "1")][0] == "UNAVAILABLE"  # its policy now the server's again: the newest version
    assert (back[0]["max_batch_size"], back[0]["model_config"]) == ("4", str(repository / "a" / "config.pbtxt"))


def spin(value: str) -> str:
    return f'parameters {{ key: "intra_op_spin_ms" value {{ string_value: "{value}" }} }}'


# What a careless edit writes over a serving model's config.pbtxt, and what the refusal names.
BAD_EDITS = {
    "unparseable": (b"max_batch_size: {{{", "not a model configuration in Triton's text format"),
    "negative batch": (b"max_batch_size: -1", "max_batch_size must be"),
    "absurd batch": (b"max_batch_size: 1000000000000", "not a model configuration"),
    "negative delay": (b"dynamic_batching { max_queue_delay_microseconds: -5 }", "not a model configuration"),
    "NaN": (spin("nan").encode(), "parameter 'intra_op_spin_ms': expected a finite number, got 'nan'"),
    "unknown parameter": (b'parameters { key: "warp_drive" value { string_value: "on" } }', "'warp_drive'"),
    "not UTF-8": (b"max_batch_size: 2 # \xff\xfe", "not a model configuration"),
    "another model's name": (b'name: "other"', "name 'other' is not the model it configures, 'a'"),
    "negative threads": (b'parameters { key: "intra_op_threads" value { string_value: "-3" } }', "intra_op_threads"),
    "threads past the cores": (b'parameters { key: "intra_op_threads" value { string_value: "64" } }', "got 64"),
    "workers past the flag": (b"instance_group [ { count: 9 } ]", "inference_workers 9 is above"),
    "empty boolean": (b'parameters { key: "dynamic_batching" value { string_value: "" } }', "dynamic_batching"),
    "a limit of zero": (b'parameters { key: "max_q_len" value { string_value: "0" } }', "max_q_len"),
    "a policy of no version": (b"version_policy { latest { num_versions: 0 } }", "version_policy must be"),
    "nested past reason": (b"optimization " + b"{ a " * 3000 + b"}" * 3000, "nested deeper than a model configuration"),
}


def test_a_bad_config_edit_keeps_the_loaded_version_serving_and_the_index_says_why(tmp_path, small_model_dir,
                                                                                 small_module):  # fmt: skip
    repository = tmp_path / "repository"
    add_version(repository, "a", 1, small_model_dir)
    config = repository / "a" / "config.pbtxt"
    config.write_text("max_batch_size: 4")
    query = rand(2, 3, SMALL_D_MODEL, seed=11)
    seen: dict[str, tuple[bool, str, np.ndarray, str]] = {}
    with repository_server(repository, "--model-control-mode", "poll", "--repository-poll-secs", "0.1") as server:
        with Client(server.url, model="a", retry=NO_RETRIES) as client:
            before = client.infer(query).output
            for edit, (text, says) in BAD_EDITS.items():
                config.write_bytes(text)
                deadline = time.monotonic() + 15
                while says not in index(server)[("a", "1")][1] and time.monotonic() < deadline:
                    time.sleep(0.05)
                state, reason = index(server)[("a", "1")]
                ready = tritongrpc.InferenceServerClient(server.url).is_model_ready("a")
                seen[edit] = (ready, state, client.infer(query).output, reason)
            config.write_text("max_batch_size: 2")  # fixed: it reloads, and the reason goes
            deadline = time.monotonic() + 15
            while served_with(server.url, "a")["max_batch_size"] != "2" and time.monotonic() < deadline:
                time.sleep(0.05)
            fixed = index(server)[("a", "1")]
        log = "".join(server.lines)
    np.testing.assert_allclose(before, eager(small_module, query)[0], atol=1e-5)
    for edit, (ready, state, answer, reason) in seen.items():
        assert (ready, state) == (True, "READY"), edit
        assert "serving the files loaded before" in reason and str(config) in reason, (edit, reason)
        assert BAD_EDITS[edit][1] in reason, (edit, reason)
        np.testing.assert_array_equal(answer, before)
        assert log.count(reason) == 1, edit  # one line in the log names the file and what was wrong
    assert fixed == ("READY", "")


def test_a_model_that_is_there_but_does_not_serve_is_unavailable_never_not_found(tmp_path, small_model_dir):
    repository = tmp_path / "repository"
    add_version(repository, "broken", 1, small_model_dir)
    (repository / "broken" / "config.pbtxt").write_text("max_batch_size: {{{")
    with repository_server(repository, "--exit-on-error", "false") as server:
        with Client(server.url, model="broken", retry=NO_RETRIES) as client:
            with pytest.raises(grpc.RpcError) as whole_model:
                client.infer(rand(1, 2, SMALL_D_MODEL))
        with Client(server.url, model="broken", version="1", retry=NO_RETRIES) as client:
            with pytest.raises(grpc.RpcError) as one_version:
                client.infer(rand(1, 2, SMALL_D_MODEL))
        with Client(server.url, model="elsewhere", retry=NO_RETRIES) as client:
            with pytest.raises(grpc.RpcError) as unknown:
                client.infer(rand(1, 2, SMALL_D_MODEL))
    for refusal in (whole_model.value, one_version.value):
        assert refusal.code() == grpc.StatusCode.UNAVAILABLE, refusal.details()
        assert "config.pbtxt" in refusal.details() and "Triton's text format" in refusal.details()
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_model_folder_served_alone_reads_its_own_config(start_server, small_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(small_model_dir, folder)
    (folder / "config.pbtxt").write_text('dynamic_batching { }\nparameters { key: "intra_op_threads" '
                                         'value { string_value: "1" } }')  # fmt: skip
    server = start_server(folder, "--dynamic-batching", "false")
    settings = served_with(server.url, "mha")
    assert settings["dynamic_batching"] == "true" and settings["intra_op_threads"] == "1"


def test_a_model_s_sequences_follow_its_config(small_model_dir, tmp_path):
    import shutil

    from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
    from tests.integration.test_sequences import step
    from tests.support import TEST_SERVER_ARGS
    from tests.support.in_process import InProcessServer

    folder = tmp_path / "model"
    shutil.copytree(small_model_dir, folder)
    config = "sequence_batching { max_sequence_idle_microseconds: 500000 }\n"
    config += 'parameters { key: "max_sequence_length" value { string_value: "8" } }'
    (folder / "config.pbtxt").write_text(config)
    args = (*TEST_SERVER_ARGS, "--sequence-idle-timeout-s", "60", "--max-sequence-length", "256")
    with InProcessServer(folder, *args) as server, grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        rows = np.ones((1, 6, SMALL_D_MODEL), np.float32)
        step(stub, 7, rows, start=True)
        with pytest.raises(grpc.RpcError) as too_long:
            step(stub, 7, rows[:, :3])
        step(stub, 8, rows[:, :1], start=True)
        time.sleep(2.0)  # past the model's 0.5 s, far within the server's 60 s
        with pytest.raises(grpc.RpcError) as dropped:
            step(stub, 8, rows[:, :1])
    assert too_long.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"would pass max_sequence_length ({folder / 'config.pbtxt'})=8" in too_long.value.details()
    assert f"dropped after 0.5 s idle (sequence_idle_timeout_s ({folder / 'config.pbtxt'}))" in dropped.value.details()
