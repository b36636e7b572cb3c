"""Reliability under load and faults, against real server processes: a soak with checked answers and
bounded memory, overload bursts that get fast refusals while accepted requests complete correctly, and
clients that vanish, stall or fall silent without holding the server's resources.

The long forms (100k-request soak, bigger bursts) are `benchmarks/reliability.py`; figures in
docs/explanation/reliability.md.
"""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import NO_RETRIES, AsyncClient, Client, RetryPolicy
from mhaserve.loadtest.checked_load import Reference, Shapes, burst, make_call, mismatch, rss_mib, run_checked_load
from mhaserve.server.process import ServerProcess, free_port
from tests.support import SMALL_D_MODEL, TEST_SERVER_ARGS, rand, scrape

SOAK_REQUESTS = int(os.environ.get("MHASERVE_SOAK_REQUESTS", "4000"))


@pytest.fixture(scope="module")
def reference(small_model_dir):
    return Reference(small_model_dir)


def pending_and_held(server) -> tuple[float, float]:
    samples = scrape(server.metrics_url)
    labels = (("model", "mha"), ("version", "1"))
    return (
        samples[("mhaserve_inference_pending_request_count", labels)],
        samples[("mhaserve_inference_inflight_bytes", ())],  # the process's budget, all models together
    )


def pending_and_answered(server) -> tuple[float, float]:
    """The model's requests queued or running, and those it answered OK, from one scrape."""
    samples = scrape(server.metrics_url)
    labels = (("model", "mha"), ("version", "1"))
    answered = sum(
        value for (name, sample_labels), value in samples.items()
        if name == "mhaserve_inference_request_total" and ("status", "OK") in sample_labels
    )  # fmt: skip
    return samples[("mhaserve_inference_pending_request_count", labels)], answered


def wait_until_idle(server, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while pending_and_held(server) != (0, 0):
        assert time.monotonic() < deadline, f"still holding (pending, bytes): {pending_and_held(server)}"
        time.sleep(0.1)


@pytest.mark.perf
def test_soak_mixed_lengths_zero_errors_checked_answers_bounded_memory(
    start_server_process, small_model_dir, reference
):
    server = start_server_process(small_model_dir, *TEST_SERVER_ARGS)
    report = asyncio.run(
        run_checked_load(
            server.url,
            Shapes(SMALL_D_MODEL, 1, 64),
            requests=SOAK_REQUESTS,
            concurrency=32,
            reference=reference,
            check_every=20,
            rss=lambda: rss_mib(server.proc.pid),
        )
    )
    print("\n" + report.summary())
    assert dict(report.statuses) == {"OK": SOAK_REQUESTS}
    assert report.checked >= SOAK_REQUESTS // 20 and report.mismatches == []
    growth = report.rss_samples_mib[-1] - report.rss_samples_mib[0]
    assert growth < 64, report.summary()  # a leak of even 16 KiB per request would pass 64 MiB
    wait_until_idle(server)


@pytest.mark.perf
def test_burst_over_capacity_gets_fast_refusals_and_correct_answers(start_server_process, small_model_dir, reference):
    # One request per run, eight waiting at most: a burst of 600 is far over what the queue takes.
    args = (*TEST_SERVER_ARGS, "--max-queue-size", "8", "--inference-workers", "1", "--dynamic-batching", "false")
    server = start_server_process(small_model_dir, *args)
    rng = np.random.default_rng(7)
    calls = [make_call(rng, Shapes(SMALL_D_MODEL, 32, 64, max_batch=8)) for _ in range(600)]
    report = asyncio.run(burst(server.url, calls, timeout_s=60))
    print("\n" + report.summary())
    assert set(report.statuses) == {"OK", "RESOURCE_EXHAUSTED"}, report.statuses
    assert report.statuses["OK"] >= 8 and report.statuses["RESOURCE_EXHAUSTED"] >= 1
    refusals = {call.details for call in calls if call.status == "RESOURCE_EXHAUSTED"}
    assert all("max_queue_size=8" in text for text in refusals), refusals
    problems = [p for call in calls if call.status == "OK" and (p := mismatch(call, reference))]
    assert problems == []
    assert server.proc.poll() is None
    wait_until_idle(server)
    with Client(server.url) as client:
        assert client.infer(rand(1, 3, SMALL_D_MODEL), timeout=10).output.shape == (1, 3, SMALL_D_MODEL)


def test_burst_of_large_requests_is_held_to_the_memory_budget(start_server, small_model_dir, reference):
    # A request [B <= 8, 64, 64] with weights holds at most about 0.8 MB: alone it always fits, but the
    # budget admits only a few at once, and 200 arrive together.
    budget = 2 << 20
    args = (*TEST_SERVER_ARGS, "--max-inflight-bytes", str(budget), "--inference-workers", "1")
    server = start_server(small_model_dir, *args)
    rng = np.random.default_rng(8)
    shapes = Shapes(SMALL_D_MODEL, 64, 64, max_batch=8, no_weights_fraction=0, cross_fraction=0)
    calls = [make_call(rng, shapes) for _ in range(200)]
    report = asyncio.run(burst(server.url, calls))
    assert set(report.statuses) == {"OK", "RESOURCE_EXHAUSTED"}, report.statuses
    problems = [p for call in calls if call.status == "OK" and (p := mismatch(call, reference))]
    assert problems == []
    refusals = {call.details for call in calls if call.status == "RESOURCE_EXHAUSTED"}
    assert refusals and all(f"max_inflight_bytes={budget}" in text for text in refusals), refusals
    wait_until_idle(server)


VANISHING_CLIENT = """
import sys, time, numpy as np, grpc
from mhaserve.client.grpc import build_infer_request
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
stub = pb_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(sys.argv[1]))
query = np.random.default_rng(0).standard_normal((4, 1024, 64), dtype=np.float32)
calls = [stub.ModelInfer.future(build_infer_request("mha", query, attn_weights=False), timeout=120)
         for _ in range(200)]
calls[0].result()
print("answered", flush=True)
time.sleep(600)
"""


def test_a_killed_client_frees_its_queue_places_and_its_requests_are_not_computed(start_server, small_model_dir):
    # Long sequences: each run costs far more than its megabyte takes to arrive, so the requests queue up.
    args = ("--max-batch-size", "16", "--max-q-len", "1024", "--max-kv-len", "1024", "--inference-workers", "1",
            "--dynamic-batching", "false", "--warmup-runs", "0", "--max-inflight-bytes", str(4 << 30))  # fmt: skip
    server = start_server(small_model_dir, *args)
    client = subprocess.Popen([sys.executable, "-c", VANISHING_CLIENT, server.url], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert client.stdout.readline().strip() == "answered"
        # Kill once the server holds a queue of them (a loaded machine sends them slowly).
        deadline = time.monotonic() + 60
        while (queued := pending_and_answered(server))[0] < 40:
            assert time.monotonic() < deadline, f"only {queued[0]} requests ever queued"
            time.sleep(0.05)
        queued, answered_then = queued
        client.send_signal(signal.SIGKILL)
        client.wait(10)
    finally:
        client.kill()
    wait_until_idle(server)
    samples = scrape(server.metrics_url)
    by_status: dict[str, float] = {}
    for (name, labels), value in samples.items():  # the model's, and calls cancelled before it was resolved
        if name == "mhaserve_inference_request_total":
            status = dict(labels)["status"]
            by_status[status] = by_status.get(status, 0) + value
    assert by_status.get("CANCELLED", 0) > 0, by_status
    assert by_status.get("OK", 0) + by_status["CANCELLED"] <= 200, by_status  # some never left the client
    with Client(server.url) as fresh:
        # One model run per request (batching off, one worker): runs beyond the answered ones were spent
        # on cancelled requests, the one running when the client died and any started before the
        # server saw the connection close. The rest of the cancelled ones were dropped unrun.
        wasted = fresh.statistics(timeout=10).execution_count - by_status.get("OK", 0)
        # Every request queued at the count is cancelled, but those answered between the count and the kill (a
        # run or two on a loaded machine).
        answered_since = by_status.get("OK", 0) - answered_then
        assert 0 <= wasted <= 5 and by_status["CANCELLED"] >= queued - answered_since, (wasted, queued, by_status)
        assert fresh.infer(rand(1, 3, SMALL_D_MODEL), timeout=10).output.shape == (1, 3, SMALL_D_MODEL)


class FreezingProxy:
    """A loopback TCP proxy that can go silent both ways without closing: a network partition."""

    def __init__(self, upstream_port: int):
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.frozen = threading.Event()
        self.upstream_closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                downstream, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            threading.Thread(target=self._pump, args=(downstream, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, downstream, True), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, from_server: bool) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                data = b""
            if not data:
                if from_server:
                    self.upstream_closed.set()  # the server hung up on the silent client
                return
            if not self.frozen.is_set():
                try:
                    target.sendall(data)
                except OSError:
                    return
            # frozen: swallow it (the server's pings never reach the client, nor the client's acks it)

    def close(self) -> None:
        self.listener.close()


def test_a_silent_client_connection_is_closed_by_keepalive_and_its_calls_dropped(start_server, small_model_dir):
    args = (*TEST_SERVER_ARGS, "--keepalive-time-s", "1", "--keepalive-timeout-s", "1")
    server = start_server(small_model_dir, *args)
    proxy = FreezingProxy(server.port)
    try:
        with Client(f"127.0.0.1:{proxy.port}") as client:
            assert client.infer(rand(1, 4, SMALL_D_MODEL), timeout=10).output is not None
            proxy.frozen.set()
            frozen_at = time.monotonic()
            # Nothing reaches either side now; the server must notice on its own and hang up.
            assert proxy.upstream_closed.wait(30), "the server kept the silent connection open"
            print(f"\nsilent connection closed by the server after {time.monotonic() - frozen_at:.1f} s")
    finally:
        proxy.close()
    wait_until_idle(server)
    with Client(server.url) as direct:
        assert direct.infer(rand(1, 3, SMALL_D_MODEL), timeout=10).output.shape == (1, 3, SMALL_D_MODEL)


@pytest.mark.perf
def test_stalled_connections_do_not_keep_others_from_being_served(server):
    stalled = []
    try:
        for i in range(200):
            sock = socket.create_connection(("127.0.0.1", server.port))
            if i % 2:
                sock.sendall(b"PRI * HTTP/2.0\r\n")  # half a connection preface, then nothing
            stalled.append(sock)
        with Client(server.url) as client:
            started = time.monotonic()
            result = client.infer(rand(2, 5, SMALL_D_MODEL), timeout=10)
            assert result.output.shape == (2, 5, SMALL_D_MODEL)
            assert time.monotonic() - started < 10
    finally:
        for sock in stalled:
            sock.close()


def test_calls_over_the_stream_limit_are_refused_before_any_work_and_the_rest_served(start_server, small_model_dir):
    server = start_server(small_model_dir, *TEST_SERVER_ARGS, "--max-concurrent-streams", "4")

    async def many():
        async with AsyncClient(server.url) as client:
            return await asyncio.gather(
                *(client.infer(rand(1, 8, SMALL_D_MODEL, seed=i), timeout=30) for i in range(40)),
                return_exceptions=True,
            )

    results = asyncio.run(many())
    refused = [r for r in results if isinstance(r, BaseException)]
    # HTTP/2 refuses the excess streams (RST_STREAM REFUSED_STREAM): the client sees UNAVAILABLE, the
    # handler never ran, and the call is safe to retry.
    assert all(r.code() == grpc.StatusCode.UNAVAILABLE and "RST_STREAM" in r.details() for r in refused)
    served = len(results) - len(refused)
    assert served >= 4
    with Client(server.url) as client:
        assert client.statistics(timeout=10).inference_stats.success.count == served


def test_the_client_retries_unavailable_with_backoff_until_a_server_comes_up(small_model_dir):
    """Inference is idempotent: a call refused UNAVAILABLE (nothing listening yet, a replica gone, a draining
    server) is sent again with backoff, by default, and succeeds once a server answers."""
    port = free_port()
    server = ServerProcess(small_model_dir, *TEST_SERVER_ARGS, port=port)
    starter = threading.Timer(0.5, server.start)
    starter.start()
    try:
        with Client(f"127.0.0.1:{port}", retry=RetryPolicy(max_attempts=200, max_backoff_s=0.25)) as client:
            answer = client.infer(rand(1, 4, SMALL_D_MODEL), timeout=60)
            assert answer.output.shape == (1, 4, SMALL_D_MODEL)
            assert client.retries > 0
    finally:
        starter.join()
        server.stop()


def answered_by(server) -> int:
    with Client(server.url) as client:
        return client.statistics(timeout=10).inference_count


def each_answered_since(servers, before: list[int]) -> bool:
    """Whether every server has answered since its counts were ``before``: a channel is connected to each."""
    return all(answered_by(server) > count for server, count in zip(servers, before, strict=True))


def until_each_answered(servers, call) -> None:
    """``call()`` again until each server has answered one: the channel is connected to all of them."""
    before = [answered_by(server) for server in servers]
    for _ in range(100):
        call()
        if each_answered_since(servers, before):
            return
    pytest.fail("100 calls over the channel, and a server answered none")


def test_an_attempt_stuck_on_a_frozen_server_is_given_up_and_answered_by_another(small_model_dir):
    """A server that stops answering without closing its connection (a node lost under a proxy, a frozen host)
    keeps a call until its deadline; with an attempt timeout the client gives the attempt up and sends the call
    again, which the channel's round robin takes to the other server."""
    servers = [ServerProcess(small_model_dir, *TEST_SERVER_ARGS, port=free_port()) for _ in range(2)]
    for server in servers:
        server.start()
    frozen = servers[0]
    target = "ipv4:" + ",".join(f"127.0.0.1:{server.port}" for server in servers)  # one channel, round robin
    query = rand(1, 4, SMALL_D_MODEL)
    try:
        with Client(target) as waits, Client(target, retry=RetryPolicy(attempt_timeout_s=0.5)) as gives_up:
            expected = waits.infer(query, timeout=30).output
            for client in (waits, gives_up):
                until_each_answered(servers, functools.partial(client.infer, query, timeout=30))
            os.kill(frozen.pid, signal.SIGSTOP)
            with pytest.raises(grpc.RpcError) as waited:  # without one, the call on the frozen server waits it out
                for _ in range(2):
                    waits.infer(query, timeout=2)
            assert waited.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and waits.retries == 0
            for _ in range(4):
                started = time.monotonic()
                np.testing.assert_array_equal(gives_up.infer(query, timeout=10).output, expected)
                assert time.monotonic() - started < 5
            assert gives_up.retries >= 1
            retries = gives_up.retries  # a sequence's step may have been applied by the attempt given up: not resent
            with pytest.raises(grpc.RpcError) as step:
                for _ in range(2):
                    gives_up.sequence().step(query, timeout=2)
            assert step.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and gives_up.retries == retries
        os.kill(frozen.pid, signal.SIGCONT)

        async def given_up_by_the_async_client() -> int:
            async with AsyncClient(target, retry=RetryPolicy(attempt_timeout_s=0.5)) as client:
                before = [answered_by(server) for server in servers]
                while not each_answered_since(servers, before):
                    await client.infer(query, timeout=30)  # until connected to both
                os.kill(frozen.pid, signal.SIGSTOP)
                for _ in range(4):
                    np.testing.assert_array_equal((await client.infer(query, timeout=10)).output, expected)
                return client.retries

        assert asyncio.run(given_up_by_the_async_client()) >= 1
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
        for server in servers:
            server.stop()


@pytest.mark.perf
def test_a_client_retries_only_retryable_statuses_and_never_past_its_deadline(server):
    with Client(f"127.0.0.1:{free_port()}", retry=RetryPolicy(max_attempts=100)) as client:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as nobody:
            client.infer(rand(1, 4, SMALL_D_MODEL), timeout=1.0)
        assert nobody.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
        assert time.monotonic() - started < 1.5 and client.retries > 0
    with Client(server.url) as client:
        with pytest.raises(grpc.RpcError) as wrong:
            client.infer(rand(1, 4, SMALL_D_MODEL + 1), timeout=10)
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT and client.retries == 0
    with Client(f"127.0.0.1:{free_port()}", retry=NO_RETRIES) as client:
        with pytest.raises(grpc.RpcError):
            client.infer(rand(1, 4, SMALL_D_MODEL), timeout=5)
        assert client.retries == 0
