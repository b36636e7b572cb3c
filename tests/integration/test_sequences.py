"""Sequences: attention over a growing sequence, one step at a time, with the keys and values kept on the server,
in Triton's sequence protocol. The steps' answers, put together, equal the stateless causal answer for the whole
sequence; the cache is bounded, counted and returned; ids that are not live are refused saying why."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import NO_RETRIES, Client, build_infer_request
from mhaserve.contract.steps import MIN_ROOM
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support import CLIENT_SCRIPTS, SMALL_D_MODEL, TEST_SERVER_ARGS, eager, rand, scrape
from tests.support.in_process import InProcessServer

D = SMALL_D_MODEL
IDLE_S = 1.5


@pytest.fixture(scope="module")
def sequence_server(small_model_dir):
    args = (*TEST_SERVER_ARGS, "--sequence-idle-timeout-s", str(IDLE_S), "--max-sequence-length", "256",
            "--max-sequences", "16")  # fmt: skip
    with InProcessServer(small_model_dir, *args) as server:
        yield server


@pytest.fixture
def stub(sequence_server):
    with grpc.insecure_channel(sequence_server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


def random_steps(length: int, rng) -> list[int]:
    steps = []
    while sum(steps) < length:
        steps.append(min(int(rng.integers(1, 9)), length - sum(steps)))
    return steps


def step(
    stub, sequence_id, rows: np.ndarray, start=False, end=False, key=None, value=None, mask=None, **parameters
) -> dict[str, np.ndarray]:
    """One step as tritonclient sends it (sequence parameters beside the request's own)."""
    request = build_infer_request("mha", rows, key=key, value=value, mask=mask)
    field = "string_param" if isinstance(sequence_id, str) else "int64_param"
    setattr(request.parameters["sequence_id"], field, sequence_id)
    request.parameters["sequence_start"].bool_param = start
    request.parameters["sequence_end"].bool_param = end
    for name, value in parameters.items():
        setattr(request.parameters[name], "int64_param" if isinstance(value, int) else "string_param", value)
        if name == "attn_top_k":
            del request.outputs[:]
    response = stub.ModelInfer(request, timeout=30)
    return {
        o.name: np.frombuffer(raw, np.float32 if o.datatype == "FP32" else np.int64).reshape(o.shape)
        for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
    }


def assert_equals_the_causal_answer(module, x, steps, answers):
    length = x.shape[1]
    want_output, want_weights = eager(module, x, mask=np.tril(np.ones((1, length, length), bool)))
    position = 0
    for rows, answer in zip(steps, answers, strict=True):
        end = position + rows
        scale = np.abs(want_output).max()
        assert np.abs(answer["output"] - want_output[:, position:end]).max() <= 1e-4 * scale
        assert np.abs(answer["attn_weights"] - want_weights[:, :, position:end, :end]).max() <= 1e-5
        position = end


@pytest.mark.parametrize("mode", ["unary", "stream"])
def test_tritonclient_grpc_steps_equal_the_stateless_causal_answer(sequence_server, small_module, tmp_path, mode):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 200, D), dtype=np.float32)
    steps = random_steps(200, rng)
    np.savez(tmp_path / "in.npz", x=x, steps=np.array(steps))
    done = subprocess.run(
        [sys.executable, str(CLIENT_SCRIPTS / "triton_sequence.py"), sequence_server.url, str(tmp_path / "in.npz"),
         str(tmp_path / "out.npz"), mode, "7001" if mode == "unary" else "chat-7001"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = np.load(tmp_path / "out.npz")
    assert "error" not in out.files, str(out["error"])
    answers = [
        {"output": out[f"step{i}_output"], "attn_weights": out[f"step{i}_attn_weights"]} for i in range(len(steps))
    ]
    assert_equals_the_causal_answer(small_module, x, steps, answers)


def test_tritonclient_http_steps_equal_the_stateless_causal_answer(sequence_server, small_module):
    import tritonclient.http as triton_http

    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, 60, D), dtype=np.float32)
    steps = random_steps(60, rng)
    client = triton_http.InferenceServerClient(sequence_server.http_url.removeprefix("http://"))
    answers, position = [], 0
    try:
        for index, rows in enumerate(steps):
            query = triton_http.InferInput("query", [1, rows, D], "FP32")
            query.set_data_from_numpy(np.ascontiguousarray(x[:, position : position + rows]))
            result = client.infer("mha", [query], sequence_id=99, sequence_start=index == 0,
                                  sequence_end=index == len(steps) - 1)  # fmt: skip
            answers.append({"output": result.as_numpy("output"), "attn_weights": result.as_numpy("attn_weights")})
            position += rows
    finally:
        client.close()
    assert_equals_the_causal_answer(small_module, x, steps, answers)


def test_tritonclient_http_steps_a_cross_attention_sequence_over_the_keys_of_its_first_step(
    sequence_server, small_module
):
    import tritonclient.http as triton_http

    rng = np.random.default_rng(23)
    query, keys, values = (rng.standard_normal((1, n, D), dtype=np.float32) for n in (5, 17, 17))
    client = triton_http.InferenceServerClient(sequence_server.http_url.removeprefix("http://"))

    def tensor(name: str, array: np.ndarray):
        given = triton_http.InferInput(name, list(array.shape), "FP32")
        given.set_data_from_numpy(np.ascontiguousarray(array))
        return given

    try:
        for row in range(5):
            inputs = [tensor("query", query[:, row : row + 1])]
            if row == 0:
                inputs += [tensor("key", keys), tensor("value", values)]
            result = client.infer("mha", inputs, sequence_id="cross-http", sequence_start=row == 0,
                                  sequence_end=row == 4)  # fmt: skip
            want_output, want_weights = eager(small_module, query[:, row : row + 1], keys, values)
            np.testing.assert_allclose(result.as_numpy("output"), want_output, atol=1e-4 * np.abs(want_output).max())
            np.testing.assert_allclose(result.as_numpy("attn_weights"), want_weights, atol=1e-5)
    finally:
        client.close()


def test_eight_sequences_interleaved_from_threads_each_equal_their_own_answer(stub, small_module):
    rng = np.random.default_rng(3)
    sequences = {f"thread-{i}": rng.standard_normal((1, 48, D), dtype=np.float32) for i in range(8)}
    plans = {name: random_steps(48, rng) for name in sequences}

    def run(name):
        x, answers, position = sequences[name], [], 0
        for index, rows in enumerate(plans[name]):
            answers.append(step(stub, name, x[:, position : position + rows], start=index == 0,
                                end=index == len(plans[name]) - 1))  # fmt: skip
            position += rows
        return answers

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = dict(zip(sequences, pool.map(run, sequences), strict=True))
    for name, answers in results.items():
        assert_equals_the_causal_answer(small_module, sequences[name], plans[name], answers)


def test_ids_that_are_not_live_are_refused_saying_why(stub):
    rows = np.ones((1, 2, D), np.float32)
    for sequence_id, why in ((123456, "never started"), ("ended-one", "ended (sequence_end)")):
        if why.startswith("ended"):
            step(stub, sequence_id, rows, start=True, end=True)
        with pytest.raises(grpc.RpcError) as refused:
            step(stub, sequence_id, rows)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sequence {sequence_id!r} is not live: {why}" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:  # the end flag without an id
        request = build_infer_request("mha", rows)
        request.parameters["sequence_end"].bool_param = True
        stub.ModelInfer(request, timeout=10)
    assert "need a 'sequence_id'" in refused.value.details()


@pytest.mark.parametrize("field,value", [("bool_param", False), ("bool_param", True), ("double_param", 0.0),
                                         ("double_param", 42.0)])  # fmt: skip
def test_only_integers_and_strings_are_ids(stub, field, value):
    request = build_infer_request("mha", np.ones((1, 2, D), np.float32))
    setattr(request.parameters["sequence_id"], field, value)
    with pytest.raises(grpc.RpcError) as refused:  # false and 0.0 were answered statelessly, as no id
        stub.ModelInfer(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'sequence_id' must be an integer or a string" in refused.value.details()


def test_a_refused_start_leaves_the_live_sequence_as_it_was(stub, small_module):
    x = np.random.default_rng(8).standard_normal((1, 7, D), dtype=np.float32)
    answers = [step(stub, "kept", x[:, :6], start=True)]
    for bad in ({"attn_top_k": 0}, {"attn_top_k": 99}):  # refused after the id was read
        with pytest.raises(grpc.RpcError) as refused:
            step(stub, "kept", x[:, :6], start=True, **bad)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    answers.append(step(stub, "kept", x[:, 6:], end=True))  # over all 7 keys, not a restart's
    assert_equals_the_causal_answer(small_module, x, [6, 1], answers)


def test_a_refused_first_step_starts_no_sequence(stub):
    rows = np.ones((1, 2, D), np.float32)
    with pytest.raises(grpc.RpcError):
        step(stub, "never", rows, start=True, attn_top_k=0)
    with pytest.raises(grpc.RpcError):
        step(stub, "never", np.ones((1, 300, D), np.float32), start=True)  # past --max-sequence-length
    with pytest.raises(grpc.RpcError) as refused:  # not answered at position 0 as if it had started
        step(stub, "never", rows)
    assert "sequence 'never' is not live: never started" in refused.value.details()


def test_a_step_whose_masked_future_would_take_the_weight_is_refused(stub, small_module):
    from tests.support.crafted import crafted_first_step

    x = crafted_first_step(small_module)  # row 0's own score below the mask's bias, its future row's small
    with pytest.raises(grpc.RpcError) as refused:
        step(stub, "crafted", x, start=True)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "where a mask no longer decides" in refused.value.details()


def test_sequence_start_with_a_live_id_restarts_it(stub, small_module):
    rng = np.random.default_rng(4)
    first, second = (rng.standard_normal((1, 5, D), dtype=np.float32) for _ in range(2))
    step(stub, 555, first, start=True)
    again = step(stub, 555, second, start=True)  # restarted: the first rows are forgotten
    assert again["attn_weights"].shape == (1, 4, 5, 5)
    assert_equals_the_causal_answer(small_module, second, [5], [again])
    step(stub, 555, second[:, :1], end=True)


def test_a_step_can_ask_for_the_newest_rows_top_keys(stub):
    rows = np.random.default_rng(5).standard_normal((1, 12, D), dtype=np.float32)
    step(stub, "topk", rows[:, :10], start=True)
    answer = step(stub, "topk", rows[:, 10:], end=True, attn_top_k=3)
    values, keys = answer["attn_weights_top_k_values"], answer["attn_weights_top_k_indices"]
    assert values.shape == keys.shape == (1, 4, 2, 3) and keys.max() <= 11 and (np.diff(values, axis=-1) <= 0).all()


def test_the_cache_is_counted_and_returned_at_end_and_at_the_idle_timeout(sequence_server, stub):
    def samples():
        values = scrape(sequence_server.metrics_url)
        return {name: value for (name, _), value in values.items() if "sequence" in name}

    before = samples()
    rows = np.ones((1, 40, D), np.float32)
    step(stub, "counted", rows, start=True)
    held = samples()
    # Keys and values of 40 rows, 4 heads of 16 (a first step's rows are its buffers, exactly): 2 x 40 x 64 float32.
    assert held["mhaserve_sequence_cache_bytes"] - before["mhaserve_sequence_cache_bytes"] == 2 * 40 * D * 4
    assert held["mhaserve_sequences_live"] == before["mhaserve_sequences_live"] + 1
    step(stub, "counted", rows[:, :1], end=True)
    assert samples()["mhaserve_sequence_cache_bytes"] == before["mhaserve_sequence_cache_bytes"]

    step(stub, "forgotten", rows, start=True)
    time.sleep(IDLE_S + 2.5)  # the server drops it by itself, whether or not other steps come
    after = samples()
    assert after["mhaserve_sequences_live"] == before["mhaserve_sequences_live"]
    assert after["mhaserve_sequences_timed_out_total"] >= before["mhaserve_sequences_timed_out_total"] + 1
    with pytest.raises(grpc.RpcError) as refused:
        step(stub, "forgotten", rows[:, :1])
    assert f"dropped after {IDLE_S:g} s idle" in refused.value.details()


def test_a_sequence_past_its_limits_is_refused_and_left_as_it_was(stub):
    rows = np.ones((1, 64, D), np.float32)
    step(stub, "long", rows, start=True)
    for _ in range(3):
        step(stub, "long", rows)  # 256 rows: the limit
    with pytest.raises(grpc.RpcError) as refused:
        step(stub, "long", rows[:, :1])
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-sequence-length=256" in refused.value.details()
    assert step(stub, "long", rows[:, :1], start=True)["attn_weights"].shape == (1, 4, 1, 1)  # a restart: free
    step(stub, "long", rows[:, :1], end=True)


def test_sequences_left_open_hold_at_most_their_share_and_stateless_calls_are_answered(start_server, small_model_dir):
    server = start_server(small_model_dir, *TEST_SERVER_ARGS, "--max-inflight-bytes", str(12 << 20))
    rows = np.ones((8, 64, D), np.float32)  # a first step keeps 8 x 64 rows of keys and values: 256 KiB
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        opened = 0
        with pytest.raises(grpc.RpcError) as refused:
            for number in range(100):  # one client opens sequences and leaves them open
                step(stub, f"left-open-{number}", rows, start=True)
                opened += 1
        cache = {n: v for (n, _), v in scrape(server.metrics_url).items() if n == "mhaserve_sequence_cache_bytes"}
        with Client(server.url, retry=NO_RETRIES) as client:
            answers = [client.infer(rand(8, 64, D, seed=n), attn_weights=True) for n in range(20)]
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--sequence-bytes-share 0.5" in refused.value.details() and "stateless" in refused.value.details()
    assert 0 < cache["mhaserve_sequence_cache_bytes"] <= 6 << 20 and opened >= 8
    assert len(answers) == 20  # every stateless call answered while the sequences stay open


def test_the_budget_refuses_a_step_that_would_not_fit_and_the_sequence_stays_as_it_was(start_server, small_model_dir):
    server = start_server(small_model_dir, *TEST_SERVER_ARGS, "--max-inflight-bytes", str(12 << 20))
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        rows = np.ones((8, 64, D), np.float32)  # each step adds 8 x 64 rows of keys and values: 256 KiB
        step(stub, "big", rows, start=True)
        grown = 1
        with pytest.raises(grpc.RpcError) as refused:
            for _ in range(64):  # the cache and each step's weights over it grow until the budget refuses
                step(stub, "big", rows)
                grown += 1
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_inflight_bytes" in refused.value.details() or "max-inflight-bytes" in refused.value.details()
        last = step(stub, "big", rows[:, :1], end=True)  # still live, as it was before the refused step
        assert last["attn_weights"].shape == (8, 4, 1, 64 * grown + 1)
        cache = {n: v for (n, _), v in scrape(server.metrics_url).items() if n == "mhaserve_sequence_cache_bytes"}
        assert cache == {"mhaserve_sequence_cache_bytes": 0}  # returned at its end


def test_a_folder_without_a_step_graph_refuses_sequences(start_server, exported, small_module):
    server = start_server(exported.folder("fp16", small_module, precision="fp16"), *TEST_SERVER_ARGS)
    with grpc.insecure_channel(server.url) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            step(pb_grpc.GRPCInferenceServiceStub(channel), 1, np.ones((1, 2, D), np.float32), start=True)
    assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "serves no sequences" in refused.value.details()


def test_a_drain_with_live_sequences_stops_cleanly(start_server, small_model_dir):
    server = start_server(small_model_dir, *TEST_SERVER_ARGS)
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        for name in ("a", "b", "c"):
            step(stub, name, np.ones((1, 8, D), np.float32), start=True)
    server.stop(drain=True)  # raises what the drain or the stop raised
    assert "Traceback" not in server.log and "ERROR" not in server.log, server.log
    assert "stopped:" in server.stop_line


@pytest.mark.parametrize("kind", ["grpc", "aio", "http"])
def test_the_projects_clients_step_a_sequence_with_a_handle(sequence_server, small_module, kind):
    import asyncio

    from mhaserve.client import AsyncClient, Client, HttpClient, WeightsOptions

    x = np.random.default_rng(6).standard_normal((1, 9, D), dtype=np.float32)
    steps = [4, 1, 4]
    if kind == "aio":

        async def run():
            async with AsyncClient(sequence_server.url) as client, client.sequence() as sequence:
                return [await sequence.step(x[:, 0:4]), await sequence.step(x[:, 4:5]),
                        await sequence.step(x[:, 5:9], end=True)]  # fmt: skip

        results = asyncio.run(run())
    else:
        client = Client(sequence_server.url) if kind == "grpc" else HttpClient(sequence_server.http_url[7:])
        with client, client.sequence() as sequence:
            results = [sequence.step(x[:, 0:4]), sequence.step(x[:, 4:5]), sequence.step(x[:, 5:9], end=True)]
            with pytest.raises(ValueError, match="has ended"):
                sequence.step(x[:, :1])
            top = client.sequence().step(x[:, :3], weights=WeightsOptions(top_k=2), end=True).top_k
            assert top[1].shape == (1, 4, 3, 2)
    answers = [{"output": r.output, "attn_weights": r.attn_weights} for r in results]
    assert_equals_the_causal_answer(small_module, x, steps, answers)


def test_steps_of_one_sequence_sent_at_once_run_one_after_the_other(stub):
    rows = np.ones((1, 3, D), np.float32)
    step(stub, "together", rows, start=True)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: step(stub, "together", rows), range(6)))
    # Each saw the cache as the steps before it left it: the keys it attends over are 3 more than another's.
    assert sorted(a["attn_weights"].shape[-1] for a in answers) == [6, 9, 12, 15, 18, 21]
    assert step(stub, "together", rows[:, :1], end=True)["attn_weights"].shape == (1, 4, 1, 22)


def test_mhaserve_infer_steps_shows_the_newest_rows_top_keys_as_it_goes(sequence_server):
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "infer", "--url", sequence_server.url, "--q-len", "9", "--steps", "4",
         "--top-k", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["rows 0..3", "rows 4..7", "row 8"]
    assert "row 8 attends most to keys" in lines[-1] and lines[-1].count("(") == 3  # two keys, and the head


def test_a_sequence_keeps_its_version_through_a_swap_and_new_ones_take_the_new(small_model_dir, small_module, tmp_path):
    import shutil

    from mhaserve.client import Client
    from mhaserve.export.writer import export_model_dir
    from mhaserve.model import seeded_module

    repository = tmp_path / "repository"
    shutil.copytree(small_model_dir, repository / "mha" / "1")
    newer = seeded_module(D, 4, seed=8)
    args = (*TEST_SERVER_ARGS, "--model-repository", str(repository), "--model-control-mode", "poll",
            "--repository-poll-secs", "0.3")  # fmt: skip
    x = np.random.default_rng(7).standard_normal((1, 12, D), dtype=np.float32)
    with InProcessServer(None, *args) as server, Client(server.url) as client:
        old = client.sequence()
        answers = [old.step(x[:, :5])]
        export_model_dir(newer, tmp_path / "v2", validation_seed=0, report=lambda _: None)
        (tmp_path / "v2").rename(repository / "mha" / "2")
        deadline = time.monotonic() + 30
        while client.infer(x[:, :1]).model_version != "2":  # the poll loads version 2; stateless calls move to it
            assert time.monotonic() < deadline, "version 2 was not served"
            time.sleep(0.2)
        answers += [old.step(x[:, 5:9]), old.step(x[:, 9:], end=True)]
        assert [a.model_version for a in answers] == ["1", "1", "1"]  # the version it started on, to its end
        fresh = client.sequence().step(x[:, :5], end=True)
    assert_equals_the_causal_answer(
        small_module, x, [5, 4, 3], [{"output": a.output, "attn_weights": a.attn_weights} for a in answers]
    )
    assert fresh.model_version == "2"
    assert_equals_the_causal_answer(
        newer, x[:, :5], [5], [{"output": fresh.output, "attn_weights": fresh.attn_weights}]
    )


def model_ready(server, name: str) -> bool:
    from mhaserve.protos.generated import grpc_service_pb2 as pb

    with grpc.insecure_channel(server.url) as channel:
        try:
            return (
                pb_grpc.GRPCInferenceServiceStub(channel).ModelReady(pb.ModelReadyRequest(name=name), timeout=10).ready
            )
        except grpc.RpcError as error:  # a model the server no longer holds at all
            if error.code() != grpc.StatusCode.NOT_FOUND:
                raise
            return False


def repository_of_one_version(small_model_dir, tmp_path):
    """A model repository holding the small model as mha version 1."""
    import shutil

    repository = tmp_path / "repository"
    shutil.copytree(small_model_dir, repository / "mha" / "1")
    return repository


def test_a_live_sequence_stalls_neither_the_poll_nor_an_unload(small_model_dir, small_module, tmp_path):
    """A sequence alive on version 1 held it UNLOADING until the sequence's idle timeout, and the whole poll with it
    (a model added meanwhile was not served); an explicit unload took as long, and meanwhile the sequence could
    neither step nor end. Now the version goes at once for new requests, and its live sequences step on it to their
    end."""
    import shutil

    from mhaserve.client import Client

    repository = repository_of_one_version(small_model_dir, tmp_path)
    args = (*TEST_SERVER_ARGS, "--model-repository", str(repository), "--model-control-mode", "poll",
            "--repository-poll-secs", "0.3", "--sequence-idle-timeout-s", "60")  # fmt: skip
    x = np.random.default_rng(9).standard_normal((1, 8, D), dtype=np.float32)
    with InProcessServer(None, *args) as server, Client(server.url) as client:
        live = client.sequence()
        answers = [live.step(x[:, :5])]
        shutil.copytree(small_model_dir, repository / "mha" / "2")  # version 1 retired by the policy
        shutil.copytree(small_model_dir, repository / "other" / "1")  # a new model, for the same poll
        # A stalled poll waits out the sequence's 60 s; a load on a loaded slow machine took over 10 s.
        deadline = time.monotonic() + 30
        while not model_ready(server, "other"):
            assert time.monotonic() < deadline, "the poll stalled behind the live sequence"
            time.sleep(0.1)
        shutil.rmtree(repository / "mha")  # and then the model goes
        deadline = time.monotonic() + 10
        while model_ready(server, "mha"):
            assert time.monotonic() < deadline, "mha was not unloaded"
            time.sleep(0.1)
        answers += [live.step(x[:, 5:7]), live.step(x[:, 7:], end=True)]  # to its end, on version 1
        with pytest.raises(grpc.RpcError):  # new sequences find no version of mha
            client.sequence().step(x[:, :1])
    assert [a.model_version for a in answers] == ["1", "1", "1"]
    assert_equals_the_causal_answer(
        small_module, x, [5, 2, 1], [{"output": a.output, "attn_weights": a.attn_weights} for a in answers]
    )


def test_an_explicit_unload_does_not_wait_for_live_sequences(small_model_dir, small_module, tmp_path):
    from mhaserve.client import Client
    from mhaserve.protos.generated import grpc_service_pb2 as pb

    repository = repository_of_one_version(small_model_dir, tmp_path)
    args = (*TEST_SERVER_ARGS, "--model-repository", str(repository), "--model-control-mode", "explicit",
            "--load-model", "mha", "--sequence-idle-timeout-s", "60")  # fmt: skip
    x = np.random.default_rng(10).standard_normal((1, 6, D), dtype=np.float32)
    with InProcessServer(None, *args) as server, Client(server.url) as client:
        live, left = client.sequence(), client.sequence()
        answers = [live.step(x[:, :4])]
        left.step(x[:, :2])  # still live on the unloaded version when the server stops
        with grpc.insecure_channel(server.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            started = time.monotonic()
            stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="mha"), timeout=30)
            took = time.monotonic() - started
        assert took < 3, f"the unload waited {took:.1f} s for the live sequence"
        assert not model_ready(server, "mha")
        answers += [live.step(x[:, 4:5]), live.step(x[:, 5:], end=True)]
    assert "Traceback" not in server.log
    assert_equals_the_causal_answer(
        small_module, x, [4, 1, 1], [{"output": a.output, "attn_weights": a.attn_weights} for a in answers]
    )


def test_a_live_sequence_does_not_keep_a_bursts_memory(start_server, small_model_dir):
    """The arenas' and the heap's free memory are given back once no request is in flight, live sequences or not
    (their caches counted as what they are): one live sequence held a burst's memory until it ended."""
    from tests.support import inflight_and_counts

    server = start_server(small_model_dir, *TEST_SERVER_ARGS)
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        step(stub, "kept", np.ones((1, 1, D), np.float32), start=True)
        step(stub, "kept", np.ones((1, 1, D), np.float32))  # its cache: 2 rows in buffers with room for 16
        cache_bytes = 2 * MIN_ROOM * D * 4
        burst = build_infer_request("mha", np.random.default_rng(11).standard_normal((8, 64, D), dtype=np.float32))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda _: stub.ModelInfer(burst, timeout=30), range(32)))
        deadline = time.monotonic() + 10
        while (held := inflight_and_counts(server)[0]) != cache_bytes and time.monotonic() < deadline:
            time.sleep(0.1)
        assert held == cache_bytes, f"{held:.0f} bytes held with only a 1-row sequence live"
        step(stub, "kept", np.ones((1, 1, D), np.float32), end=True)


def test_a_cross_attention_sequence_steps_its_queries_over_every_key_it_was_given(stub, small_module):
    """Keys and values given with the first step (and more with a later one), queries stepping over them: each
    step's rows equal eager's answer for those rows over every key given so far."""
    rng = np.random.default_rng(21)
    query, keys, values = (rng.standard_normal((2, n, D), dtype=np.float32) for n in (12, 30, 30))
    plan = [(3, 20), (1, 0), (4, 0), (2, 10), (2, 0)]  # (query rows, keys it brings)
    position = held = 0
    for number, (rows, new_keys) in enumerate(plan):
        given = {"key": keys[:, held : held + new_keys], "value": values[:, held : held + new_keys]} if new_keys else {}
        answer = step(stub, "cross", query[:, position : position + rows], start=number == 0,
                      end=number == len(plan) - 1, **given)  # fmt: skip
        held += new_keys
        want_output, want_weights = eager(small_module, query[:, position : position + rows], keys[:, :held],
                                          values[:, :held])  # fmt: skip
        assert answer["attn_weights"].shape == (2, 4, rows, held)
        np.testing.assert_allclose(answer["output"], want_output, atol=1e-4 * np.abs(want_output).max())
        np.testing.assert_allclose(answer["attn_weights"], want_weights, atol=1e-5)
        position += rows


def test_a_step_that_does_not_fit_its_sequence_is_refused_and_changes_nothing(stub, small_module):
    rows = np.random.default_rng(22).standard_normal((1, 6, D), dtype=np.float32)
    step(stub, "self", rows[:, :2], start=True)
    with pytest.raises(grpc.RpcError) as refused:  # keys for a self-attention sequence
        step(stub, "self", rows[:, 2:3], key=rows[:, 3:5])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "input 'key'" in refused.value.details() and "self-attention sequence" in refused.value.details()
    with pytest.raises(grpc.RpcError) as refused:  # a mask on a step
        step(stub, "self", rows[:, 2:3], mask=np.ones((1, 1, 3), bool))
    assert "input 'mask'" in refused.value.details()
    answer = step(stub, "self", rows[:, 2:3], end=True)  # the sequence as it was: two rows before this one
    want_output, _ = eager(small_module, rows[:, :3], mask=np.tril(np.ones((1, 3, 3), bool)))
    np.testing.assert_allclose(answer["output"], want_output[:, 2:3], atol=1e-4 * np.abs(want_output).max())


def test_a_step_resent_after_its_answer_was_lost_is_refused_naming_both_positions_never_applied_twice(
    stub, small_module
):
    x = rand(1, 6, D, seed=61)
    answers = [step(stub, "resent", x[:, :2], start=True, sequence_position=0)]
    answers.append(step(stub, "resent", x[:, 2:4], sequence_position=2))
    # the client lost that answer and sends the same step again
    with pytest.raises(grpc.RpcError) as resent:
        step(stub, "resent", x[:, 2:4], sequence_position=2)
    assert resent.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "holds 4 rows; this step is for position 2" in resent.value.details()
    with pytest.raises(grpc.RpcError) as gap:  # a step past rows that never arrived
        step(stub, "resent", x[:, 5:6], sequence_position=5)
    assert gap.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "the steps for row 4 never arrived" in gap.value.details()
    answers.append(step(stub, "resent", x[:, 4:6], end=True, sequence_position=4))  # the sequence is as it was
    assert_equals_the_causal_answer(small_module, x, [2, 2, 2], answers)
    with pytest.raises(grpc.RpcError) as first:
        step(stub, "other", x[:, :1], start=True, sequence_position=3)
    assert first.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "first step is at position 0" in (
        first.value.details()
    )


@pytest.mark.parametrize("cross", [False, True], ids=["self-attention", "cross-attention"])
def test_a_sequence_the_server_lost_is_started_again_from_what_the_client_kept_with_resume(
    sequence_server, small_module, cross
):
    x, keys = rand(1, 6, D, seed=62), rand(1, 9, D, seed=63)
    with Client(sequence_server.url) as client:
        sequence = client.sequence(resume=True)
        if cross:
            sequence.step(x[:, :2], key=keys[:, :6], value=keys[:, :6])
        else:
            sequence.step(x[:, :2])
            sequence.step(x[:, 2:4])
        time.sleep(IDLE_S + 1.5)  # dropped idle: lost to the server
        given = {"key": keys[:, 6:], "value": keys[:, 6:]} if cross else {}
        answer = sequence.step(x[:, 4:6], **given)
        assert sequence.restarts == 1
        after = sequence.step(x[:, 2:3] if cross else rand(1, 1, D, seed=64))
    if cross:  # each query row over every key given so far
        want = eager(small_module, x[:, 4:6], keys, keys)[0]
        np.testing.assert_allclose(answer.output, want, atol=1e-5)
        np.testing.assert_allclose(after.output, eager(small_module, x[:, 2:3], keys, keys)[0], atol=1e-5)
    else:
        rows = np.concatenate([x, rand(1, 1, D, seed=64)], axis=1)
        want = eager(small_module, rows, mask=np.tril(np.ones((1, 7, 7), bool)))[0]
        np.testing.assert_allclose(answer.output, want[:, 4:6], atol=1e-5)
        assert answer.attn_weights.shape == (1, small_module.num_heads, 2, 6)
        np.testing.assert_allclose(after.output, want[:, 6:7], atol=1e-5)
