"""The data plane in the test's own event loop, no transport: a request decoded into the neutral form, run
through ``DataPlane.inference``, and what it leaves in the budget, the statistics and the outcome counts."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mhaserve.server.config import ServerSettings
from mhaserve.server.dataplane import DataPlane
from mhaserve.server.errors import ErrorKind, RequestError
from mhaserve.server.inference import InferenceRequest, RequestedOutput, SharedInput
from mhaserve.server.shared_memory import Placement
from tests.support import SMALL_D_MODEL, assert_documented, eager, rand


def request_of(query: np.ndarray, *outputs: str, model: str = "mha", **parameters) -> InferenceRequest:
    return InferenceRequest(
        model, "", "req-1", {"query": query}, tuple(RequestedOutput(name) for name in outputs), parameters
    )


def run(scenario, model_dir, **settings):
    """``scenario(dataplane)`` on a started data plane serving ``model_dir``, in a loop of its own."""

    async def main():
        dataplane = DataPlane(ServerSettings(warmup_runs=0, **settings), model_dir)
        await dataplane.start()
        try:
            return await scenario(dataplane)
        finally:
            dataplane.shutdown()

    return asyncio.run(main())


async def infer(dataplane: DataPlane, request: InferenceRequest, peer: str = "127.0.0.1"):
    async with dataplane.inference("test", peer=peer) as call:
        return await call.infer(request)


def test_one_call_answers_eagers_values_and_is_counted_once(small_model_dir, small_module):
    query = rand(2, 5, SMALL_D_MODEL, seed=4)

    async def scenario(dataplane):
        response = await infer(dataplane, request_of(query, "output", "attn_weights"))
        served = dataplane.resolve("mha", "")
        return response, dataplane.accounting.outcomes, served.stats, dataplane.accounting.budget.request_bytes

    response, outcomes, stats, held = run(scenario, small_model_dir)
    want_out, want_weights = eager(small_module, query, query, query)
    np.testing.assert_allclose(response.outputs["output"], want_out, atol=1e-5)
    np.testing.assert_allclose(response.outputs["attn_weights"], want_weights, atol=1e-6)
    assert list(response.outputs) == ["output", "attn_weights"] and response.id == "req-1"
    assert outcomes == {"OK": 1} and stats.inference_count == 2 and stats.execution_count == 1
    assert held == 0  # nothing of the call is left in the budget once it ended


@pytest.mark.parametrize(
    "request_, kind, words",
    [
        (request_of(rand(1, 3, SMALL_D_MODEL), model="nope"), ErrorKind.NOT_FOUND, "unknown model 'nope'"),
        (request_of(rand(1, 3, SMALL_D_MODEL + 1)), ErrorKind.INVALID_ARGUMENT, "query"),
        (request_of(rand(1, 3, SMALL_D_MODEL), "nothing_such"), ErrorKind.INVALID_ARGUMENT, "nothing_such"),
        (request_of(rand(1, 3, SMALL_D_MODEL), attn_top_k=[4]), ErrorKind.INVALID_ARGUMENT, "attn_top_k"),
    ],
)
def test_a_refused_request_has_its_status_and_leaves_nothing_held(small_model_dir, request_, kind, words):
    async def scenario(dataplane):
        with pytest.raises(RequestError) as refused:
            await infer(dataplane, request_)
        return refused.value, dataplane.accounting.outcomes, dataplane.accounting.budget

    error, outcomes, budget = run(scenario, small_model_dir)
    assert error.kind == kind and words in error.message, error.message
    assert outcomes == {kind.name: 1} and budget.request_bytes == 0 and budget.idle
    assert_documented(error)  # the errors reference lists what the caller got


def test_a_request_over_the_budget_is_refused_before_it_runs(small_model_dir):
    async def scenario(dataplane):
        with pytest.raises(RequestError) as refused:
            await infer(dataplane, request_of(rand(4, 60, SMALL_D_MODEL), "output", "attn_weights"))
        served = dataplane.resolve("mha", "")
        return refused.value, served.stats.execution_count, dataplane.accounting.budget.request_bytes

    error, runs, held = run(scenario, small_model_dir, max_inflight_bytes=200_000)
    assert error.kind == ErrorKind.RESOURCE_EXHAUSTED and "max_inflight_bytes=200000" in error.message
    assert_documented(error)
    assert runs == 0 and held == 0


def test_received_bytes_count_until_admission_and_a_full_budget_refuses_them_unread(small_model_dir):
    async def scenario(dataplane):
        budget = dataplane.accounting.budget
        async with dataplane.inference("test") as call:
            call.receipt.add(1000)
            during = budget.request_bytes
            await call.infer(request_of(rand(1, 3, SMALL_D_MODEL)))
        after = budget.request_bytes
        with pytest.raises(RequestError) as refused:
            async with dataplane.inference("test") as call:
                call.receipt.add(budget.limit + 1)
        return during, after, refused.value, budget.request_bytes

    during, after, error, held = run(scenario, small_model_dir)
    assert during == 1000 and after == 0 and held == 0
    assert error.kind == ErrorKind.RESOURCE_EXHAUSTED and "the request as received" in error.message


def test_an_answer_delivered_later_stays_in_the_budget_until_sent(small_model_dir):
    async def scenario(dataplane):
        budget = dataplane.accounting.budget
        async with dataplane.inference("test") as call:
            await call.infer(request_of(rand(1, 6, SMALL_D_MODEL), "attn_weights"))
            call.deliver_later()
        waiting = budget.request_bytes, dict(dataplane.accounting.outcomes)
        call.record_delivery(False, 0)  # the client never took it
        return waiting, budget.request_bytes, dataplane.accounting.outcomes

    (held, outcomes_before), held_after, outcomes = run(scenario, small_model_dir)
    assert held > 0 and outcomes_before == {}
    assert held_after == 0 and outcomes == {"CANCELLED": 1}


def test_shared_memory_is_refused_to_a_caller_not_on_this_host(small_model_dir):
    placement = Placement("region", 0, 3 * SMALL_D_MODEL * 4)
    request = InferenceRequest(
        "mha", "", "", {}, (), {}, {"query": SharedInput("FP32", (1, 3, SMALL_D_MODEL), placement)}
    )

    async def scenario(dataplane):
        with pytest.raises(RequestError) as far:
            await infer(dataplane, request, peer="ipv4:10.1.2.3:5000")
        with pytest.raises(RequestError) as near:
            await infer(dataplane, request, peer="ipv4:127.0.0.1:5000")
        return far.value, near.value

    far, near = run(scenario, small_model_dir, allow_client_shm=True)
    assert far.kind == ErrorKind.PERMISSION_DENIED
    assert near.kind == ErrorKind.INVALID_ARGUMENT and "unknown shared memory region 'region'" in near.message


def test_a_draining_data_plane_refuses_new_calls_as_retryable(small_model_dir):
    async def scenario(dataplane):
        dataplane.drain(port_open_s=1.0)
        with pytest.raises(RequestError) as refused:
            await infer(dataplane, request_of(rand(1, 3, SMALL_D_MODEL)))
        return refused.value, dataplane.reports_ready

    error, ready = run(scenario, small_model_dir)
    assert error.kind == ErrorKind.UNAVAILABLE and "retry elsewhere" in error.message and not ready


def test_a_lone_small_request_runs_on_the_event_loop_and_any_other_in_the_server_sends_it_to_a_worker(
    small_model_dir, small_module
):
    import threading

    small, large = rand(1, 8, SMALL_D_MODEL, seed=1), rand(1, 512, SMALL_D_MODEL, seed=2)

    async def scenario(dataplane):
        batcher = dataplane.resolve("mha", "").batched.batcher
        run_model, on_the_loop = batcher._run_model, []

        def recording(*args):
            on_the_loop.append(threading.current_thread() is threading.main_thread())
            return run_model(*args)

        batcher._run_model = recording

        async def after_a_pause(query):
            while batcher._idle_workers < batcher.workers:  # a loaded machine may free the worker late
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.01)  # no run ended just now
            return await infer(dataplane, request_of(query, "output"))

        answers = [await after_a_pause(small)]  # alone: on the loop
        dataplane.accounting.requests_being_read += 1  # another client's request arriving (gRPC counts it)
        answers.append(await after_a_pause(small))
        dataplane.accounting.requests_being_read -= 1
        async with dataplane.inference("test"):  # another call in the server
            answers.append(await after_a_pause(small))
        answers.append(await after_a_pause(large))  # too large a run to hold the loop for
        answers.append(await after_a_pause(small))  # alone again
        held = threading.Event()
        dataplane._executor.submit(held.wait, 10)  # the inference thread busy ...
        dataplane.accounting._release_idle_memory()  # ... and the idle release waiting for it
        giving_back = asyncio.ensure_future(after_a_pause(small))
        await asyncio.sleep(0.1)
        held.set()
        answers.append(await giving_back)  # a run beside the release would race it: after it, on the thread
        return answers, on_the_loop

    answers, on_the_loop = run(scenario, small_model_dir)
    assert on_the_loop == [True, False, False, False, True, False]
    for answer, query in zip(answers, (small, small, small, large, small, small), strict=True):
        np.testing.assert_allclose(answer.outputs["output"], eager(small_module, query, query, query)[0], atol=1e-5)
