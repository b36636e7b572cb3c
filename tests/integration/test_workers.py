"""``mhaserve serve --workers N`` as a user runs it, a real process tree: N serving processes on one gRPC and one
HTTP port, the connections spread over them by the kernel, one /metrics for the whole server, a worker that dies
started again, SIGTERM draining every one, and what cannot work across processes refused before any starts."""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import sys
import time
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from mhaserve.client.common import SequenceStep
from mhaserve.client.grpc import Client, GrpcRequestFailed, build_infer_request
from mhaserve.client.http import HttpClient
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.server.cores import usable_cores
from tests.support import SMALL_D_MODEL, by_worker, eager, rand, worker_that_took

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT's spreading is Linux's")

WORKER_PID = re.compile(r"worker (\d+) started \(pid (\d+)\)")


def worker_pids(server) -> dict[int, int]:
    """Each worker's latest process, from the parent's log."""
    return {int(i): int(pid) for i, pid in WORKER_PID.findall(server.log)}


def requests_by_worker(server) -> dict[str, float]:
    return by_worker(server, "mhaserve_inference_request_total", status="OK")


def answered(url: str, query: np.ndarray) -> np.ndarray:
    """The output from a fresh connection; a connection the kernel had queued on a worker that was just killed is
    reset (UNAVAILABLE), and the client's retry, on a new connection, reaches a worker that serves."""
    for attempt in range(3):
        try:
            with Client(url) as client:
                return client.infer(query).output
        except GrpcRequestFailed as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE or attempt == 2:
                raise
            time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_share_the_ports_answer_as_one_server_and_stop_together(
    start_server_process, small_model_dir, small_module
):
    server = start_server_process(small_model_dir, "--workers", "2", "--metrics-port", "0")
    assert "processes=2" in server.log and "intra_op_threads=1" in server.log  # two cores, one thread each
    for seed in range(16):  # a connection each: the kernel spreads them over the workers
        query = rand(1, 3, SMALL_D_MODEL, seed=seed)
        with Client(server.url) as client:
            np.testing.assert_allclose(client.infer(query).output, eager(small_module, query)[0], atol=1e-5)
    http = HttpClient(server.http_url.removeprefix("http://"))  # HTTP/REST on its one port too
    np.testing.assert_allclose(http.infer(query).output, eager(small_module, query)[0], atol=1e-5)
    counts = requests_by_worker(server)  # one /metrics, each worker's series labelled
    assert set(counts) == {"0", "1"} and sum(counts.values()) == 17, counts
    with Client(server.url) as client:  # statistics from whichever worker answers: the whole server's
        stats = client.statistics()
        settings = {key: value.string_value for key, value in client.config().parameters.items()}
    # each worker runs on its share of the threads, and on every core's while the other runs nothing
    cores = usable_cores()
    assert settings["intra_op_threads_alone"] == (str(cores) if cores > 1 else "0"), settings
    assert stats.inference_count == 17 and stats.inference_stats.success.count == 17
    assert http.statistics()["inference_count"] == 17
    pids = worker_pids(server)
    server.signal(signal.SIGTERM)
    assert server.wait_exit(60) == 0
    assert "stopped: 2 workers, 0 restarts" in server.log
    assert not any(alive(pid) for pid in pids.values())


def test_a_load_test_over_several_connections_reaches_every_worker_and_keeps_each_sequence_on_its_own(
    start_server_process, small_model_dir
):
    server = start_server_process(small_model_dir, "--workers", "2", "--metrics-port", "0")
    stateless = Workload(SMALL_D_MODEL, 1, 3, 3, connections=16)  # one connection would reach one worker
    steps = Workload(SMALL_D_MODEL, 1, 1, 1, attn_weights=False, sequence_length=4, connections=16)
    with LoadGenerator(server.url, 1) as load:  # one client process
        for workload in (stateless, steps):
            before = requests_by_worker(server)
            result = load.measure(workload, Point("closed", 16, 1.0, 0.2))
            # a caller's steps keep to its connection, so to the worker that holds its sequence
            assert result.count > 0 and not result.errors, result.errors
            after = requests_by_worker(server)
            assert all(after.get(worker, 0) > before.get(worker, 0) for worker in ("0", "1")), (before, after)

    # The same from the project's client: clients of one process share a connection, unless each asks for its own.
    query = rand(1, 2, SMALL_D_MODEL, seed=2)
    for own_connection, workers_reached in ((False, 1), (True, 2)):
        before = requests_by_worker(server)
        clients = [Client(server.url, own_connection=own_connection) for _ in range(16)]
        for client in clients:
            client.infer(query, attn_weights=False)
        for client in clients:
            client.close()
        after = requests_by_worker(server)
        reached = [worker for worker in ("0", "1") if after.get(worker, 0) > before.get(worker, 0)]
        assert len(reached) == workers_reached, (own_connection, before, after)


def test_a_worker_that_dies_is_started_again_and_the_server_keeps_answering(
    start_server_process, small_model_dir, small_module
):
    server = start_server_process(small_model_dir, "--workers", "2", "--metrics-port", "0")
    killed = worker_pids(server)[1]
    os.kill(killed, signal.SIGKILL)
    query = rand(1, 2, SMALL_D_MODEL, seed=1)
    deadline = time.monotonic() + 60
    exited = f"(pid {killed}) exited"
    while exited not in server.log or "worker 1 ready:" not in server.log.split(exited, 1)[1]:
        # meanwhile the other worker answers (the restarted one listens only once it is loaded)
        np.testing.assert_allclose(answered(server.url, query), eager(small_module, query)[0], atol=1e-5)
        assert time.monotonic() < deadline, server.log[-3000:]
        time.sleep(0.2)
    assert f"worker 1 (pid {killed}) exited with signal 9; starting it again" in server.log
    assert worker_pids(server)[1] != killed and alive(worker_pids(server)[1])
    for seed in range(8):
        with Client(server.url) as client:
            assert client.infer(rand(1, 2, SMALL_D_MODEL, seed=seed)).output.shape == (1, 2, SMALL_D_MODEL)


def test_a_parent_killed_outright_leaves_no_worker_behind(start_server_process, small_model_dir):
    server = start_server_process(small_model_dir, "--workers", "2")
    pids = worker_pids(server).values()
    server.signal(signal.SIGKILL)  # no drain, no forwarding: the workers are told by the kernel
    server.wait_exit(30)
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a worker outlived its parent"
        time.sleep(0.1)


def test_explicit_model_control_with_a_config_shared_memory_and_log_settings_reach_every_worker_and_a_restarted_one(
    start_server_process, small_model_dir, small_module, tmp_path
):
    shutil.copytree(small_model_dir, tmp_path / "repository" / "mha" / "1")
    repository = ("--model-repository", str(tmp_path / "repository"), "--model-control-mode", "explicit")
    server = start_server_process(None, *repository,
                                  "--workers", "2", "--allow-client-shm", "true", "--metrics-port", "0")  # fmt: skip
    query = rand(1, 3, SMALL_D_MODEL, seed=11)
    want = eager(small_module, query)[0]

    def refuses_three_rows(client: Client) -> None:
        with pytest.raises(GrpcRequestFailed) as refused:
            client.infer(rand(3, 2, SMALL_D_MODEL))
        assert "max_batch_size=2 (set by the load request's config)" in refused.value.details()

    with grpc.insecure_channel(server.url) as channel:  # one connection: one worker takes the calls
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        load = pb.RepositoryModelLoadRequest(model_name="mha")
        load.parameters["config"].string_param = '{"max_batch_size": 2}'  # in place of its config.pbtxt, in all
        stub.RepositoryModelLoad(load)
        access_on = pb.LogSettingsRequest()
        access_on.settings["access_log"].bool_param = True
        stub.LogSettings(access_on)
    before = requests_by_worker(server)
    registering = Client(server.url, own_connection=True)
    regions = registering.shared_memory()  # registered through one worker, used through both
    for index in range(12):  # a connection each: the kernel spreads them over both workers
        with Client(server.url, own_connection=True) as client:
            np.testing.assert_allclose(client.infer(query, request_id=f"a{index}").output, want, atol=1e-5)
            np.testing.assert_allclose(client.infer(query, shared_memory=regions).output, want, atol=1e-5)
            refuses_three_rows(client)
    after = requests_by_worker(server)
    assert all(after.get(worker, 0) > before.get(worker, 0) for worker in ("0", "1")), (before, after)

    killed = worker_pids(server)[1]  # started again, it takes the others' model and regions
    os.kill(killed, signal.SIGKILL)
    deadline = time.monotonic() + 60
    exited = f"(pid {killed}) exited"
    while exited not in server.log or "worker 1 ready:" not in server.log.split(exited, 1)[1]:
        assert time.monotonic() < deadline, server.log[-3000:]
        time.sleep(0.2)
    before = requests_by_worker(server)
    retries = 0
    for index in range(48):  # new connections until one reaches the restarted worker (the kernel's hash picks)
        with Client(server.url, own_connection=True) as client:
            answer = client.infer(query, shared_memory=regions, request_id=f"b{index}")
            np.testing.assert_allclose(answer.output, want, atol=1e-5)
            refuses_three_rows(client)
            retries += client.retries
        if requests_by_worker(server).get("1", 0) > before.get("1", 0):
            break
    else:
        raise AssertionError(f"48 connections, none served by the restarted worker ({retries} calls retried)")
    time.sleep(0.3)  # an access line is written once the answer has left
    logged = "".join(line for line in server.lines if "mhaserve.access" in line)
    # every call's line, whichever worker took it, the restarted one's too (the access log on in all)
    missing = [f"{kind}{i}" for kind, count in (("a", 12), ("b", index + 1)) for i in range(count)
               if f"id='{kind}{i}'" not in logged]  # fmt: skip
    assert not missing, missing

    with grpc.insecure_channel(server.url) as channel:  # unloaded through one worker: by every one
        pb_grpc.GRPCInferenceServiceStub(channel).RepositoryModelUnload(
            pb.RepositoryModelUnloadRequest(model_name="mha")
        )
    for _ in range(8):
        with Client(server.url, own_connection=True) as client, pytest.raises(GrpcRequestFailed) as refused:
            client.infer(query)
        assert refused.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
    regions.close()
    registering.close()


def causal_rows(module, rows: np.ndarray) -> np.ndarray:
    """Each row's output attending every row up to it: what a sequence's steps answer, row by row."""
    length = rows.shape[1]
    return eager(module, rows, mask=np.tril(np.ones((length, length), dtype=bool))[None])[0]


def forwarded_steps(server) -> float:
    return sum(by_worker(server, "mhaserve_sequence_steps_forwarded_total", status="OK").values())


def test_a_sequences_steps_reach_the_worker_that_holds_it_from_any_new_connection_grpc_or_http(
    start_server_process, small_model_dir, small_module
):
    server = start_server_process(small_model_dir, "--workers", "2", "--metrics-port", "0")
    http_url = server.http_url.removeprefix("http://")
    steps = 4
    for number in range(12):  # gRPC unary, HTTP/REST (urllib: a new connection per request), a gRPC stream each
        rows = rand(1, steps, SMALL_D_MODEL, seed=100 + number)
        want = causal_rows(small_module, rows)
        for position in range(steps):
            step = SequenceStep(f"seq-{number}", start=position == 0, end=position == steps - 1)
            row = rows[:, position : position + 1]
            if number % 3 == 1:
                answer = HttpClient(http_url).infer(row, attn_weights=False, sequence=step)
            elif number % 3 == 2:
                answer = streamed(server.url, row, step)
            else:
                with Client(server.url, own_connection=True) as client:  # a connection of its own each step
                    answer = client.infer(row, attn_weights=False, sequence=step)
            np.testing.assert_allclose(answer.output[:, 0], want[:, position], atol=1e-5, err_msg=f"{number}")
    # 48 steps on 48 new connections over two workers: some reached the worker without their sequence
    assert forwarded_steps(server) > 0, server.log[-2000:]
    with Client(server.url) as client:
        assert client.statistics().inference_count == 12 * steps  # each step counted once, where it ran


def streamed(url: str, row: np.ndarray, step: SequenceStep):
    """One step over a ModelStreamInfer stream of its own, on a connection of its own."""
    request = build_infer_request("mha", row, attn_weights=False, sequence=step)
    with grpc.insecure_channel(url, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        (answer,) = pb_grpc.GRPCInferenceServiceStub(channel).ModelStreamInfer(iter([request]), timeout=30)
    assert not answer.error_message, answer.error_message
    output = answer.infer_response.outputs[0]
    array = np.frombuffer(answer.infer_response.raw_output_contents[0], np.float32).reshape(output.shape)
    return SimpleNamespace(output=array)


def test_sequences_stepped_over_one_connection_live_in_its_worker_and_are_never_forwarded(
    start_server_process, small_model_dir, small_module
):
    """A client's channel (the Python client's, tritonclient's) or a stream keeps to one connection, so to one
    worker: its sequences start there, and their steps are answered there, with no hop to another worker."""
    server = start_server_process(small_model_dir, "--workers", "2", "--metrics-port", "0")
    rows = {number: rand(1, 4, SMALL_D_MODEL, seed=200 + number) for number in range(8)}
    with Client(server.url, own_connection=True) as client:
        for position in range(4):  # eight sequences stepped in turn
            for number, sent in rows.items():
                step = SequenceStep(f"one-connection-{number}", start=position == 0, end=position == 3)
                answer = client.infer(sent[:, position : position + 1], attn_weights=False, sequence=step)
                want = causal_rows(small_module, sent)[:, position]
                np.testing.assert_allclose(answer.output[:, 0], want, atol=1e-5)
    for number in range(4):  # and a stream's sequence, on a connection of its own
        sent = rand(1, 1, SMALL_D_MODEL, seed=300 + number)
        streamed(server.url, sent, SequenceStep(f"streamed-{number}", start=True, end=True))
    assert forwarded_steps(server) == 0
    with Client(server.url) as client:
        assert client.statistics().inference_count == 8 * 4 + 4


def test_a_clients_share_of_sequences_holds_for_the_whole_server_whichever_worker_its_connections_reach(
    start_server_process, small_model_dir, tmp_path
):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token-0123456789\nbob bob-token-0123456789\n")
    server = start_server_process(small_model_dir, "--workers", "2", "--metrics-port", "0",
                                  "--auth-token-file", str(tokens), "--max-sequences-per-client", "2")  # fmt: skip
    row = rand(1, 1, SMALL_D_MODEL, seed=3)
    for number in range(2):  # each start on a connection of its own
        with Client(server.url, token="alice-token-0123456789", own_connection=True) as alice:
            alice.infer(row, attn_weights=False, sequence=SequenceStep(f"a{number}", start=True))
    for _ in range(4):  # wherever the connection lands, the third is over alice's share
        with Client(server.url, token="alice-token-0123456789", own_connection=True) as alice:
            with pytest.raises(GrpcRequestFailed) as refused:
                alice.infer(row, attn_weights=False, sequence=SequenceStep("a2", start=True))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sequences-per-client=2" in refused.value.details()
    with Client(server.url, token="bob-token-0123456789", own_connection=True) as bob:  # bob's share is his own
        bob.infer(row, attn_weights=False, sequence=SequenceStep("b0", start=True))


def test_a_step_whose_worker_died_says_its_sequence_was_lost_and_how_to_go_on(
    start_server_process, small_model_dir, small_module
):
    server = start_server_process(small_model_dir, "--workers", "2", "--metrics-port", "0")
    name = "seq-lost"
    row, rows = rand(1, 1, SMALL_D_MODEL, seed=4), rand(1, 5, SMALL_D_MODEL, seed=5)
    with Client(server.url, own_connection=True) as client:
        first = SequenceStep(name, start=True)  # it lives where its first step was answered
        home = worker_that_took(server, functools.partial(client.infer, row, attn_weights=False, sequence=first))
        client.infer(row, attn_weights=False, sequence=SequenceStep("seq-again", start=True))  # the same worker
    for attempt in range(40):  # a resuming client whose connection reached the same worker
        resumed = Client(server.url, own_connection=True).sequence(f"seq-kept-{attempt}", resume=True)  # keeps rows
        if worker_that_took(server, functools.partial(resumed.step, rows[:, :2])) == home:
            break
        resumed.step(rows[:, 2:3], end=True)
        resumed.client.close()
    else:
        pytest.fail("40 connections, none reached the worker holding the first sequence")
    killed = worker_pids(server)[home]
    os.kill(killed, signal.SIGKILL)
    while alive(killed):
        time.sleep(0.05)
    with Client(server.url, own_connection=True) as client:  # only the other worker listens now
        with pytest.raises(GrpcRequestFailed) as lost:
            client.infer(row, attn_weights=False, sequence=SequenceStep(name))
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "lost" in lost.value.details() and "sequence_start" in lost.value.details()
        # started again as the message says: in the worker that took the step
        client.infer(row, attn_weights=False, sequence=SequenceStep("seq-again", start=True))
        client.infer(row, attn_weights=False, sequence=SequenceStep("seq-again", end=True))
    deadline = time.monotonic() + 60
    exited = f"(pid {killed}) exited"
    while exited not in server.log or f"worker {home} ready:" not in server.log.split(exited, 1)[1]:
        assert time.monotonic() < deadline, server.log[-3000:]
        time.sleep(0.2)
    with Client(server.url, own_connection=True) as client:  # restarted: it says the sequence was lost with it
        with pytest.raises(GrpcRequestFailed) as gone:
            client.infer(row, attn_weights=False, sequence=SequenceStep(name))
    assert gone.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"lost when worker {home} of this server restarted" in gone.value.details(), gone.value.details()
    answers = [resumed.step(rows[:, 2:4]), resumed.step(rows[:, 4:5], end=True)]  # started again from what it kept
    assert resumed.restarts == 1
    got = np.concatenate([answer.output for answer in answers], axis=1)
    np.testing.assert_allclose(got, causal_rows(small_module, rows)[:, 2:], atol=1e-5)
    resumed.client.close()
