"""The server's life: NOT_SERVING until loaded and warmed, then SERVING; on SIGTERM under load every accepted
request is answered, new ones are refused, and the process exits 0. Message limits fit the largest request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mhaserve.client.grpc import NO_RETRIES, AsyncClient, Client, build_infer_request
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from mhaserve.server.process import ServerProcess, free_port
from tests.support import SMALL_D_MODEL, scrape

D = SMALL_D_MODEL
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
# A client that tries before the port is bound backs off for about a second before it tries again, which
# can outlast the whole load; these tests watch the load, so their channels retry every few milliseconds.
FAST_RECONNECT = [("grpc.initial_reconnect_backoff_ms", 10), ("grpc.min_reconnect_backoff_ms", 10),
                  ("grpc.max_reconnect_backoff_ms", 50)]  # fmt: skip


def test_health_is_not_serving_until_warm_then_serving(start_server_process, small_model_dir):
    port = free_port()
    # 200 warm-up runs at each of three shapes keep the model loading for about a second on a slow 2-core machine:
    # long enough to watch (tens of polls), short enough to end well within the deadline on a busy machine, which
    # slows loading many times over (4000 runs took 8 s alone and over a minute beside the rest of the suite).
    process = start_server_process(small_model_dir, "--warmup-runs", "200", port=port, wait=False)
    observed = []  # (health status, ServerReady) pairs, in order
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=FAST_RECONNECT) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and (not observed or observed[-1][0] != SERVING):
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status
                    ready = stub.ServerReady(pb.ServerReadyRequest(), timeout=1).ready
                    observed.append((status, ready))
                except grpc.RpcError as error:  # not bound yet, or (a loaded machine) not answered within 1 s
                    assert error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                time.sleep(0.01)
            # while loading, inference is refused as UNAVAILABLE rather than left hanging
        # Health and ServerReady are two calls, so one poll may straddle the switch; each signal on its
        # own must go from not-ready to ready exactly once and never back.
        health_seen = [status for status, _ in observed]
        ready_seen = [ready for _, ready in observed]
        assert health_seen[0] == NOT_SERVING and not ready_seen[0], observed[:3]
        assert health_seen[-1] == SERVING and ready_seen[-1], observed[-3:]
        first_serving = health_seen.index(SERVING)
        assert set(health_seen[:first_serving]) == {NOT_SERVING} and set(health_seen[first_serving:]) == {SERVING}
        first_ready = ready_seen.index(True)
        assert not any(ready_seen[:first_ready]) and all(ready_seen[first_ready:])
        process.wait_serving()
    finally:
        process.stop()


def test_inference_while_loading_is_unavailable(start_server_process, small_model_dir):
    port = free_port()
    process = start_server_process(small_model_dir, "--warmup-runs", "4000", port=port, wait=False)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=FAST_RECONNECT) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            health.Check(health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True)
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                stub.ModelInfer(build_infer_request("mha", np.zeros((1, 2, D), np.float32)), timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "not ready" in error.value.details() or "loading" in error.value.details()
    finally:
        process.stop()


def queued_requests(server) -> float:
    samples = scrape(server.metrics_url)
    return sum(value for (name, _), value in samples.items() if name == "mhaserve_inference_pending_request_count")


def test_sigterm_under_load_answers_every_accepted_request(start_server_process, small_model_dir, small_module):
    # One request a run on one inference thread: the first request the largest, so that the others arrive while it
    # runs and queue behind it. The signal comes once eight wait in the queue, whatever has arrived by then (how fast
    # receipt and runs go relative to each other depends on the machine's load; waiting for every call to arrive
    # first, on a loaded machine the runs kept up and nothing queued).
    # The default drain, as a user's server has it (test servers close at once): without it, on a loaded host, calls
    # sent before the signal but not yet taken from gRPC by the busy event loop were cut off CANCELLED. The client
    # retries what the drain refuses, after the port has closed as the refusal says (a retry sent as it closed was
    # cut off too).
    args = ("--max-batch-size", "16", "--max-q-len", "512", "--grace-seconds", "30", "--warmup-runs", "0",
            "--inference-workers", "1", "--drain-seconds", "1")  # fmt: skip
    server = start_server_process(small_model_dir, *args)
    rng = np.random.default_rng(0)
    queries = [rng.standard_normal((16, 512, D), dtype=np.float32)]
    queries += [rng.standard_normal((4, 384, D), dtype=np.float32) for _ in range(23)]

    finished_at = []

    async def timed_infer(client, x):
        result = await client.infer(x, attn_weights=False, timeout=60)
        finished_at.append(time.monotonic())
        return result

    async def load():
        nonlocal signalled_at
        async with AsyncClient(server.url) as client:
            calls = [asyncio.ensure_future(timed_infer(client, queries[0]))]
            await asyncio.sleep(0.05)
            calls += [asyncio.ensure_future(timed_infer(client, x)) for x in queries[1:]]
            deadline = time.monotonic() + 30
            while (queued := await asyncio.to_thread(queued_requests, server)) < 8:
                assert time.monotonic() < deadline, f"{queued} queued, {len(finished_at)} answered"
                await asyncio.sleep(0.01)
            signalled_at = time.monotonic()
            server.signal()
            await asyncio.sleep(0.2)
            health = health_pb2_grpc.HealthStub(client._channel)
            try:
                late_status = (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status
            except grpc.aio.AioRpcError as error:
                late_status = error.code()
            results = await asyncio.gather(*calls, return_exceptions=True)
            return results, late_status

    signalled_at = None
    try:
        results, late_status = asyncio.run(load())
        # A call that reached the server after the signal is refused before it is read (or, retried, finds the port
        # closed): UNAVAILABLE, retryable elsewhere. Every call the server had accepted is answered, and correctly.
        refused = [r for r in results if isinstance(r, BaseException)]
        assert all(error.code() == grpc.StatusCode.UNAVAILABLE for error in refused), [
            (error.code(), error.details()) for error in refused if error.code() != grpc.StatusCode.UNAVAILABLE
        ]
        answered = [(x, r) for x, r in zip(queries, results, strict=True) if not isinstance(r, BaseException)]
        # the signal really came under load: the eight queued were answered after it
        assert sum(t > signalled_at for t in finished_at) >= 8
        with torch.no_grad():
            for x, result in answered:
                np.testing.assert_allclose(result.output, small_module(torch.from_numpy(x))[0].numpy(), atol=1e-5)
        # after SIGTERM: not serving (or the port already closed to new calls)
        assert late_status in (NOT_SERVING, grpc.StatusCode.UNAVAILABLE)
        assert server.wait_exit(60) == 0
        # The server's own count: as many OK as the client got, the rest refused, none cut off.
        stopped = next(line for line in server.log.splitlines() if "stopped: inference calls by status:" in line)
        outcomes, in_flight = stopped.split("by status: ", 1)[1].split("; ")
        outcomes = dict(outcome.split(" ") for outcome in outcomes.split(", "))
        assert outcomes.pop("OK") == str(len(answered)) and set(outcomes) <= {"UNAVAILABLE"}, stopped
        assert "shutting down" in server.log and in_flight == "0 in flight at exit", stopped
        # and nothing new is accepted once it is gone
        with Client(server.url) as client, pytest.raises(grpc.RpcError) as error:
            client.infer(queries[0], timeout=2)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_a_call_refused_by_a_draining_server_is_retried_only_once_its_port_has_closed(
    start_server_process, small_model_dir
):
    # A retry sent while the port is still open is refused again, and one that reaches gRPC as the port closes is
    # cut off CANCELLED, which no client retries. The refusal says when to come back: once the port has closed.
    drain_s = 3.0
    server = start_server_process(small_model_dir, "--drain-seconds", str(drain_s), "--warmup-runs", "0")
    x = np.zeros((1, 4, D), dtype=np.float32)
    try:
        with Client(server.url) as client, Client(server.url, retry=NO_RETRIES) as once:
            client.infer(x)
            server.signal()
            health = health_pb2_grpc.HealthStub(once._channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != NOT_SERVING:
                time.sleep(0.01)
            refused_at = time.monotonic()

            with pytest.raises(grpc.RpcError) as error:
                once.infer(x, timeout=5)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.value.details()
            pushback_ms = int(dict(error.value.trailing_metadata())["grpc-retry-pushback-ms"])
            assert 1000 < pushback_ms <= (drain_s + 1) * 1000

            body = {"inputs": [{"name": "query", "shape": [1, 1, D], "datatype": "FP32", "data": [0.0] * D}]}
            request = urllib.request.Request(server.http_url + "/v2/models/mha/infer", json.dumps(body).encode())
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=5)
            assert refused.value.code == 503 and 1 < int(refused.value.headers["Retry-After"]) <= drain_s + 1

            with pytest.raises(grpc.RpcError) as error:  # the default retries: the last finds the port closed
                client.infer(x, timeout=30)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            assert client.retries >= 1 and time.monotonic() - refused_at > drain_s
        assert server.wait_exit(30) == 0
        # Each call was refused by the server once: no retry reached it while it drained.
        stopped = next(line for line in server.log.splitlines() if "stopped: inference calls by status:" in line)
        assert "inference calls by status: OK 1, UNAVAILABLE 3;" in stopped, stopped
    finally:
        server.stop()


def test_sigint_also_stops_cleanly(start_server_process, small_model_dir):
    server = start_server_process(small_model_dir, "--warmup-runs", "0")
    server.signal(signal.SIGINT)
    assert server.wait_exit(30) == 0


def test_default_limits_carry_the_largest_request_and_response(start_server, small_model_dir, small_module):
    # [1, 512, 512] with weights: the response is over gRPC's default 4 MiB.
    server = start_server(small_model_dir, "--warmup-runs", "0")
    x = np.random.default_rng(1).standard_normal((1, 512, D), dtype=np.float32)
    with Client(server.url) as client:
        result = client.infer(x)
    assert result.attn_weights.shape == (1, 4, 512, 512)  # 4 MiB of weights alone
    with torch.no_grad():
        np.testing.assert_allclose(result.attn_weights, small_module(torch.from_numpy(x))[1].numpy(), atol=1e-5)
    # a channel with gRPC's default limits cannot receive it: the reason the client raises its own
    with grpc.insecure_channel(server.url) as channel:
        with pytest.raises(grpc.RpcError) as error:
            pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(build_infer_request("mha", x), timeout=30)
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_sigterm_while_loading_stops_at_once(small_model_dir):
    # It was ignored until the load ended (a large model takes seconds); 40000 warm-up runs take several here.
    import socket

    port = free_port()
    process = ServerProcess(small_model_dir, "--warmup-runs", "40000", "--device", "cpu", port=port)
    process.start(wait=False)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the port is bound just before the load begins
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.02)
        time.sleep(0.3)
        assert "serving model=" not in process.log
        sent = time.monotonic()
        process.signal()
        assert process.wait_exit(20) == 0
        assert time.monotonic() - sent < 3, process.log
        assert "stopped while loading the model" in process.log and "Traceback" not in process.log
    finally:
        process.stop()


def test_sigterm_during_the_start_stops_a_containers_first_process(small_model_dir):
    # In a container the server is process 1, and the kernel delivers it no signal it has no handler for: a stop
    # during the start (the imports, a first export) was lost, and the engine killed it after its grace period.
    # ``unshare`` makes the server process 1 of a PID namespace of its own, as a container engine does.
    process = ServerProcess(small_model_dir, "--device", "cpu")
    process.command = ["unshare", "--pid", "--fork", "--kill-child", *process.command]
    process.start(wait=False)
    try:
        first = _child_of(process.pid)
        while not _handles(first, signal.SIGTERM):  # the command's own first line; the server's comes later
            assert process.alive, process.log
            time.sleep(0.002)
        sent = time.monotonic()
        os.kill(first, signal.SIGTERM)
        assert process.wait_exit(10) == 128 + signal.SIGTERM
        assert time.monotonic() - sent < 3, process.log
        assert "stopped (SIGTERM)" in process.log and "Traceback" not in process.log
    finally:
        process.stop()


def _child_of(pid: int, timeout: float = 10) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            if children := Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
                return int(children[0])
        time.sleep(0.002)
    raise AssertionError(f"process {pid} started no child in {timeout} s")


def _handles(pid: int, signum: int) -> bool:
    caught = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def test_health_watch_streams_are_bounded_and_check_stays_open(start_server, small_model_dir):
    # Open to anyone (health needs no token), Watch streams were unbounded: 4000 held 81 MiB.
    async def scenario(url):
        async with grpc.aio.insecure_channel(url) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            watches = [health.Watch(health_pb2.HealthCheckRequest()) for _ in range(3)]
            for watch in watches:
                assert (await watch.read()).status == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await health.Watch(health_pb2.HealthCheckRequest()).read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_health_watchers=3" in refused.value.details()
            assert (await health.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
            watches[0].cancel()  # a closed stream frees its place
            await asyncio.sleep(0.2)
            again = health.Watch(health_pb2.HealthCheckRequest())
            assert (await again.read()).status == SERVING
            for watch in (*watches[1:], again):
                watch.cancel()

    server = start_server(small_model_dir, "--max-health-watchers", "3", "--warmup-runs", "0")
    asyncio.run(scenario(server.url))


def test_the_servers_phases_each_say_so_in_process(small_model_dir, caplog):
    """bind, load, serve, drain and stop, driven one by one in this test's event loop: health and the ready
    RPC follow them, a drained server refuses new calls as retryable, and the stop line counts the calls."""
    from mhaserve.server.app import Server
    from tests.support.in_process import InProcessServer

    settings = InProcessServer(small_model_dir, "--warmup-runs", "0", "--drain-seconds", "1").settings

    async def phases() -> dict[str, object]:
        server, seen = Server(settings), {}
        await server.bind()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = pb_grpc.GRPCInferenceServiceStub(channel)

            async def state() -> tuple[int, bool]:
                checked = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
                return checked.status, (await stub.ServerReady(pb.ServerReadyRequest(), timeout=5)).ready

            seen["bound"] = await state()
            await server.load()
            seen["loaded"] = await state()
            await server.serve()
            seen["serving"] = await state()
            async with AsyncClient(f"127.0.0.1:{server.port}", retry=NO_RETRIES) as client:
                await client.infer(np.ones((1, 3, D), np.float32))
                draining = asyncio.create_task(server.drain())  # the port stays open for drain_seconds
                await asyncio.sleep(0.2)
                seen["draining"] = await state()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await client.infer(np.ones((1, 3, D), np.float32), timeout=5)
                seen["refused"] = refused.value.code(), refused.value.details()
                await draining
        await server.stop()
        return seen

    caplog.set_level(logging.INFO, logger="mhaserve.server")
    seen = asyncio.run(phases())
    lines = [record.getMessage() for record in caplog.records if record.name == "mhaserve.server"]
    assert seen["bound"] == (NOT_SERVING, False)
    assert seen["loaded"] == (NOT_SERVING, True)  # the models serve; health waits for the serve phase
    assert seen["serving"] == (SERVING, True)
    assert seen["draining"] == (NOT_SERVING, False)
    assert any(line.startswith("serving model=mha version=1") for line in lines)
    code, details = seen["refused"]
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details, details
    assert lines[-1] == "stopped: inference calls by status: OK 1, UNAVAILABLE 1; 0 in flight at exit", lines[-3:]
