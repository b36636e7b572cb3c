"""Dynamic batching: requests of different lengths, masks and outputs share a model run and each gets its
own unbatched answer; the queue is bounded; expired and cancelled requests are never computed."""

from __future__ import annotations

import asyncio
import time

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import NO_RETRIES, AsyncClient, Client
from mhaserve.server.errors import SHED_REASONS
from tests.support import SMALL_D_MODEL, eager, rand, scrape
from tests.support.requests import infer_concurrently, merged_when_all_queued, mixed_requests

D = SMALL_D_MODEL


def test_concurrent_mixed_lengths_each_equal_eager(start_server, small_model_dir, small_module):
    requests = mixed_requests(24, seed=3)
    args = ("--max-q-len", "64", "--max-kv-len", "64", "--warmup-runs", "1", *merged_when_all_queued(requests))
    server = start_server(small_model_dir, *args)
    with Client(server.url) as client:
        before = client.statistics()
        results = infer_concurrently(server.url, requests)
        after = client.statistics()
    for (query, key, value, mask, weights), result in zip(requests, results, strict=True):
        want_out, want_attn = eager(small_module, query, key, value, mask)
        np.testing.assert_allclose(result.output, want_out, rtol=0, atol=1e-5)
        if weights:
            np.testing.assert_allclose(result.attn_weights, want_attn, rtol=0, atol=1e-5)
        else:
            assert result.attn_weights is None
    runs = after.execution_count - before.execution_count
    rows = after.inference_count - before.inference_count
    assert rows == sum(q.shape[0] for q, *_ in requests)
    assert runs < len(requests) // 2, f"{len(requests)} concurrent requests took {runs} runs: not merged"
    assert any(b.batch_size > 3 for b in after.batch_stats)  # more rows than any one request has


def test_batching_off_runs_each_request_alone(start_server, small_model_dir):
    server = start_server(small_model_dir, "--dynamic-batching", "false", "--warmup-runs", "0")
    requests = mixed_requests(8, seed=5)

    async def call_all():
        async with AsyncClient(server.url) as client:
            return await asyncio.gather(*(client.infer(q, k, v, m, timeout=60) for q, k, v, m, _ in requests))

    results = asyncio.run(call_all())
    with Client(server.url) as client:
        stats = client.statistics()
    assert len(results) == 8 and stats.execution_count == 8


# Slow enough (about 20-60 ms a run at d_model 64) that a queue builds behind it.
def slow_query(seed=0):
    return rand(16, 384, D, seed=seed)


NONE_SHED = dict.fromkeys(SHED_REASONS, 0)


def shed_by_reason(server) -> dict[str, float]:
    """mhaserve_inference_request_shed_total of the served model, by reason."""
    samples = scrape(server.metrics_url)
    return {dict(labels)["reason"]: value for (name, labels), value in samples.items()
            if name == "mhaserve_inference_request_shed_total" and dict(labels)["model"] == "mha"}  # fmt: skip


def pending_requests(server) -> float:
    samples = scrape(server.metrics_url)
    return sum(value for (name, _), value in samples.items() if name == "mhaserve_inference_pending_request_count")


def test_full_queue_refuses_at_once_and_serves_what_it_accepted(start_server, small_model_dir, small_module):
    args = ("--max-queue-size", "2", "--max-batch-size", "16", "--max-q-len", "384", "--max-kv-len", "384")
    server = start_server(small_model_dir, *args, "--warmup-runs", "0")
    queries = [slow_query(seed) for seed in range(12)]

    async def timed(client, query):
        started = time.perf_counter()
        try:
            result = await client.infer(query, attn_weights=False, timeout=120)
            return "OK", result, time.perf_counter() - started
        except grpc.aio.AioRpcError as error:
            return error.code(), error.details(), time.perf_counter() - started

    async def call_all():
        async with AsyncClient(server.url) as client:
            return await asyncio.gather(*(timed(client, q) for q in queries))

    outcomes = asyncio.run(call_all())
    with Client(server.url) as client:
        stats = client.statistics()
        assert client.infer(rand(1, 4, D)).output.shape == (1, 4, D)  # still serving
        with pytest.raises(grpc.RpcError) as over_its_limit:  # the client's doing: refused, not shed
            client.infer(rand(17, 2, D))
    shed = shed_by_reason(server)
    refused = [o for o in outcomes if o[0] == grpc.StatusCode.RESOURCE_EXHAUSTED]
    served = [(q, o) for q, o in zip(queries, outcomes, strict=True) if o[0] == "OK"]
    assert len(refused) + len(served) == len(queries), [o[0] for o in outcomes]
    assert refused and served
    assert all("queue is full" in details and "max_queue_size=2" in details for _, details, _ in refused)
    slowest_served = max(seconds for _, (_, _, seconds) in served)
    assert all(seconds < slowest_served for *_, seconds in refused)  # refused at once, not after waiting
    for query, (_, result, _) in served:
        np.testing.assert_allclose(result.output, eager(small_module, query)[0], rtol=0, atol=1e-5)
    assert stats.inference_count == 16 * len(served)  # the refused ones were never computed
    assert over_its_limit.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert shed == NONE_SHED | {"queue_full": len(refused)}


@pytest.mark.parametrize("fault", ["deadline", "cancel"])
def test_expired_or_cancelled_requests_leave_the_queue_uncomputed(start_server, small_model_dir, fault):
    # A long queue delay holds whatever is queued for HOLD_S, however fast or slow the machine is: a marker starts
    # the wait, the victims queue behind it and expire or are cancelled within it, and the run at its end takes
    # the marker alone. (A long run holding the worker raced on a loaded machine: the marker could run first.)
    hold_s = 6.0
    args = ("--max-batch-size", "64", "--max-queue-delay-us", str(int(hold_s * 1e6)))
    server = start_server(small_model_dir, *args, "--warmup-runs", "0")

    async def until(condition, what: str) -> None:
        deadline = time.monotonic() + hold_s
        while not await asyncio.to_thread(condition):
            assert time.monotonic() < deadline, f"{what} did not happen within the queue delay ({hold_s} s)"
            await asyncio.sleep(0.005)

    async def scenario():
        async with AsyncClient(server.url) as client:
            marker = asyncio.create_task(client.infer(rand(1, 4, D), timeout=120))
            await until(lambda: pending_requests(server) >= 1, "the marker's queueing")
            if fault == "deadline":
                victims = [client.infer(rand(1, 4, D), timeout=1.0) for _ in range(5)]
                outcomes = await asyncio.gather(*victims, return_exceptions=True)
                codes = {e.code() for e in outcomes}
                assert codes == {grpc.StatusCode.DEADLINE_EXCEEDED}, codes
            else:
                victims = [asyncio.create_task(client.infer(rand(1, 4, D), timeout=60)) for _ in range(5)]
                await until(lambda: pending_requests(server) >= 6, "the victims' queueing")
                for task in victims:
                    task.cancel()
                outcomes = await asyncio.gather(*victims, return_exceptions=True)
                assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
            assert not marker.done()  # still held: the victims left the queue before any run
            return await marker

    started = time.monotonic()
    assert asyncio.run(scenario()).output.shape == (1, 4, D)
    assert time.monotonic() - started >= hold_s * 0.9  # the marker was held for the delay, not run at once
    with Client(server.url) as client:
        stats = client.statistics()
    # Only the marker was ever computed: one run of one row; the five victims were dropped from the queue.
    assert stats.inference_count == 1 and stats.execution_count == 1, stats
    assert pending_requests(server) == 0


def test_padding_share_is_a_metric_and_the_flag_keeps_one_padded_run(start_server, small_model_dir, small_module):
    from tests.support import scrape

    requests = [(rand(1, 2, D, seed=s), None, None, None, True) for s in range(4)]
    requests += [(rand(1, 64, D, seed=10 + s), None, None, None, True) for s in range(4)]
    runs = {}
    for flag in ("false", "true"):
        # A cap of the eight rows sends the run once all have come; the long delay waits for them on a busy machine.
        args = ("--max-q-len", "64", "--max-kv-len", "64", "--max-batch-size", "8", "--max-queue-delay-us", "2000000")
        server = start_server(small_model_dir, *args, "--length-aware-batching", flag, "--warmup-runs", "1")

        async def call_all(server=server):
            async with AsyncClient(server.url) as client:
                return await asyncio.gather(*(client.infer(q, timeout=60) for q, *_ in requests))

        results = asyncio.run(call_all())
        samples = scrape(server.metrics_url)
        for (query, *_), result in zip(requests, results, strict=True):
            np.testing.assert_allclose(result.output, eager(small_module, query)[0], rtol=0, atol=1e-5)
        count = {n: v for (n, _), v in samples.items() if n.startswith("mhaserve_inference_padding_ratio")}
        runs[flag] = (count["mhaserve_inference_padding_ratio_count"], count["mhaserve_inference_padding_ratio_sum"])
    # Off: the eight requests, gathered up to the cap, share one run padded to 64 (about half padding).
    assert runs["false"][0] == 1 and runs["false"][1] > 0.4
    # On: the server's fitted cost model decides; whatever it chose, no run is padded more than the single one.
    assert runs["true"][0] >= 1 and runs["true"][1] / runs["true"][0] <= runs["false"][1] + 1e-9


def test_a_later_start_of_the_same_graph_reuses_the_fitted_run_cost_unless_told_not_to(
    start_server, small_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("MHASERVE_CACHE", str(tmp_path))

    def started(*flags) -> str:
        server = start_server(small_model_dir, "--warmup-runs", "1", *flags)
        server.stop()
        return next(line for line in server.log.splitlines() if "run cost model" in line).split("run cost model ")[1]

    first = started()
    assert first.startswith("(CPU per run, fitted at warm-up)")
    assert len(list((tmp_path / "run-costs").glob("*.json"))) == 1
    again = started()
    assert again.startswith("(CPU per run, fitted at an earlier start on this machine, 20")
    assert again.split("): ")[1] == first.split("): ")[1]  # the same prices
    # other threads make other runs, and the flag asks for a fit at every start
    assert started("--intra-op-threads", "1").startswith("(CPU per run, fitted at warm-up)")  # 2 cores: 2 by default
    assert started("--run-cost-cache", "false").startswith("(CPU per run, fitted at warm-up)")
    assert len(list((tmp_path / "run-costs").glob("*.json"))) == 2


def test_a_request_past_its_queue_timeout_is_refused_unavailable_and_may_shorten_it(start_server, small_model_dir):
    import json
    import urllib.error
    import urllib.request

    import tritonclient.grpc as tritongrpc
    from tritonclient.utils import InferenceServerException

    # A queue delay of 3 s keeps each lone request waiting for company: its queue timeout ends the wait first.
    server = start_server(small_model_dir, "--max-queue-delay-us", "3000000", "--queue-timeout-us", "100000",
                          "--allow-timeout-override", "true", "--warmup-runs", "0")  # fmt: skip
    client = tritongrpc.InferenceServerClient(server.url)
    query = tritongrpc.InferInput("query", [1, 2, D], "FP32")
    query.set_data_from_numpy(rand(1, 2, D))
    refusals = {}
    for timeout_us in (None, 20_000, 500_000):  # none, shorter than the model's, longer (no say)
        started = time.monotonic()
        with pytest.raises(InferenceServerException) as refused:
            client.infer("mha", [query], timeout=timeout_us)
        refusals[timeout_us] = (refused.value.status(), refused.value.message(), time.monotonic() - started)
    for timeout_us, set_by in ((None, "--queue-timeout-us"), (20_000, "the request's 'timeout' parameter"),
                               (500_000, "--queue-timeout-us")):  # fmt: skip
        status, message, took_s = refusals[timeout_us]
        assert status == "StatusCode.UNAVAILABLE" and "it was not computed" in message, message
        limit_ms = 20 if timeout_us == 20_000 else 100
        assert f"past its queue timeout of {limit_ms} ms ({set_by})" in message, message
        assert took_s < 2.0  # refused at its timeout, not at the queue delay's end
    body = {"inputs": [{"name": "query", "shape": [1, 1, D], "datatype": "FP32", "data": [0.5] * D}],
            "parameters": {"timeout": "soon"}}  # fmt: skip
    request = urllib.request.Request(server.http_url + "/v2/models/mha/infer", data=json.dumps(body).encode())
    with pytest.raises(urllib.error.HTTPError) as malformed:
        urllib.request.urlopen(request, timeout=30)
    assert malformed.value.code == 400
    assert "parameter 'timeout' must be an integer, got a string 'soon'" in json.loads(malformed.value.read())["error"]
    with Client(server.url) as ours:
        assert ours.statistics().execution_count == 0  # none of them was computed
    assert shed_by_reason(server)["queue_timeout"] == 3  # load shed, told apart from other UNAVAILABLE answers


def test_without_a_queue_timeout_a_requests_timeout_parameter_changes_nothing(start_server, small_model_dir):
    import tritonclient.grpc as tritongrpc

    server = start_server(small_model_dir, "--allow-timeout-override", "true", "--warmup-runs", "0")
    query = tritongrpc.InferInput("query", [1, 2, D], "FP32")
    query.set_data_from_numpy(rand(1, 2, D))
    answer = tritongrpc.InferenceServerClient(server.url).infer("mha", [query], timeout=1)  # as in Triton
    assert answer.as_numpy("output").shape == (1, 2, D)


def test_a_request_of_an_earlier_priority_level_goes_ahead_of_those_waiting_at_later_ones(
    start_server, small_model_dir
):
    import threading

    import tritonclient.grpc as tritongrpc

    args = ("--dynamic-batching", "false", "--inference-workers", "1", "--max-batch-size", "16", "--max-q-len", "384",
            "--max-kv-len", "384", "--priority-levels", "2", "--default-priority-level", "2",
            "--warmup-runs", "0")  # fmt: skip
    server = start_server(small_model_dir, *args)
    assert any(" queue_timeout_us=0 priority_levels=2 " in line for line in server.lines if "serving " in line)
    finished: list[str] = []

    def send(name: str, priority: int) -> None:
        client = tritongrpc.InferenceServerClient(server.url)
        query = tritongrpc.InferInput("query", [16, 384, D], "FP32")
        query.set_data_from_numpy(slow_query(len(finished)))
        client.infer("mha", [query], outputs=[tritongrpc.InferRequestedOutput("output")], priority=priority)
        finished.append(name)

    # four runs hold the one worker (on a CPU several times this one's speed, still longer than the sends take)
    # while three requests queue at the default level, then one at level 1
    order = [*((f"busy-{i}", 0) for i in range(4)), ("later-1", 0), ("later-2", 2), ("later-3", 9), ("first", 1)]
    senders = []
    for name, priority in order:  # 0 and 9 (past the last level) take the default, 2
        senders.append(threading.Thread(target=send, args=(name, priority)))
        senders[-1].start()
        time.sleep(0.002)  # each sent after the one before
    for sender in senders:
        sender.join(60)
    assert sorted(finished) == sorted(name for name, _ in order)
    waiting = [name for name in finished if not name.startswith("busy")]
    # it came last and is served before those of the later level still waiting (the first of them may have
    # started before it came)
    assert waiting.index("first") <= 1, finished


def test_a_priority_level_with_a_queue_policy_of_its_own_waits_as_that_says(start_server, small_model_dir):
    # A queue delay of 4 s keeps requests waiting for company: level 2 may hold two of them, level 1's wait 50 ms.
    policy = "1:default_timeout_microseconds=50000;2:max_queue_size=2"
    server = start_server(small_model_dir, "--max-queue-delay-us", "4000000", "--priority-levels", "2",
                          "--default-priority-level", "2", "--priority-queue-policy", policy,
                          "--warmup-runs", "0")  # fmt: skip
    query = rand(1, 2, D, seed=3)

    async def scenario():
        async with AsyncClient(server.url, retry=NO_RETRIES) as client:  # each refusal once
            queued = [asyncio.ensure_future(client.infer(query, attn_weights=False)) for _ in range(2)]
            while await asyncio.to_thread(pending_requests, server) < 2:  # both waiting at the default level, 2
                await asyncio.sleep(0.01)
            with pytest.raises(grpc.aio.AioRpcError) as level_full:
                await client.infer(query, attn_weights=False, priority=2)
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as timed_out:
                await client.infer(query, attn_weights=False, priority=1)
            waited = time.monotonic() - started
            return level_full.value, timed_out.value, waited, await asyncio.gather(*queued)

    level_full, timed_out, waited, served = asyncio.run(scenario())
    import tritonclient.grpc as tritongrpc

    config = tritongrpc.InferenceServerClient(server.url).get_model_config("mha", as_json=True)["config"]
    assert level_full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (
        "priority level 2's queue is full (2 of its requests waiting, its max_queue_size=2, --priority-queue-policy)"
        in level_full.details()
    )
    assert timed_out.code() == grpc.StatusCode.UNAVAILABLE
    assert "queue timeout of 50 ms (priority level 1's, --priority-queue-policy)" in timed_out.details()
    assert waited < 1.5  # refused at its level's timeout, not at the queue delay's end
    assert [answer.output.shape for answer in served] == [(1, 2, D)] * 2
    assert shed_by_reason(server) == NONE_SHED | {"queue_full": 1, "queue_timeout": 1}
    levels = config["dynamic_batching"]["priority_queue_policy"]
    assert (levels["1"]["default_timeout_microseconds"], levels["2"]["max_queue_size"]) == ("50000", 2)
