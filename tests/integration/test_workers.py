"""``mhaserve serve --workers N`` as a user runs it, a real process tree: N serving processes on one gRPC and one
HTTP port, the connections spread over them by the kernel, one /metrics for the whole server, a worker that dies
started again, SIGTERM draining every one, and what cannot work across processes refused before any starts."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import Client, GrpcRequestFailed
from mhaserve.client.http import HttpClient
from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload
from mhaserve.server.cores import usable_cores
from tests.support import SMALL_D_MODEL, eager, rand

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT's spreading is Linux's")

WORKER_PID = re.compile(r"worker (\d+) started \(pid (\d+)\)")


def worker_pids(server) -> dict[int, int]:
    """Each worker's latest process, from the parent's log."""
    return {int(i): int(pid) for i, pid in WORKER_PID.findall(server.log)}


def requests_by_worker(server) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("mhaserve_inference_request_total{") and 'status="OK"' in line:
            worker = re.search(r'worker="(\d+)"', line).group(1)
            counts[worker] = counts.get(worker, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


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


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (("--model-control-mode", "explicit"), "would reach one worker alone"),
        (("--allow-client-shm", "true"), "unknown to the others"),
    ],
)
def test_what_cannot_work_across_workers_is_refused_in_one_line(small_model_dir, tmp_path, flags, said):
    where = ("--model-repository", str(tmp_path)) if "explicit" in flags else ("--model-dir", str(small_model_dir))
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "serve", *where, "--workers", "2", *flags, "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and said in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
