"""The in-flight memory budget (--max-inflight-bytes) against the memory the server really takes: a flood stays
under baseline + budget, refused requests leave nothing behind, and memory goes back near baseline when idle.

Real server processes; RSS read from /proc. The budget's model of a request (inputs, answer, ONNX Runtime's
run workspace) is in server/memory.py, fitted to benchmarks/bench_memory.py's per-shape figures.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import Client
from mhaserve.loadtest.checked_load import (
    Reference,
    Shapes,
    burst,
    make_call,
    mismatch,
    peak_rss_mib,
    reset_peak_rss,
    rss_mib,
)
from mhaserve.server.memory import InflightBytesExceeded, MemoryBudget
from tests.support import SMALL_D_MODEL, budget_once_idle, inflight_and_counts, rand, scrape

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/status")

D = SMALL_D_MODEL
LIMITS = ("--max-batch-size", "8", "--max-q-len", "2048", "--max-kv-len", "2048", "--warmup-runs", "1")


@pytest.mark.perf
def test_refused_requests_leave_no_memory_behind(start_server_process, small_model_dir):
    # grpc.aio keeps an aborted call's exception in a reference cycle: each refused request's message and
    # arrays stayed until a full garbage collection, about 700 MiB after a flood of refused 4 MiB requests.
    query = rand(8, 2048, D)  # a 4 MiB message, refused by a budget smaller than it
    server = start_server_process(small_model_dir, *LIMITS, "--max-inflight-bytes", str(1 << 20))
    with Client(server.url) as client:
        codes = []

        def send(count: int) -> None:
            for _ in range(count):
                try:
                    client.infer(query, attn_weights=False, timeout=30)
                except grpc.RpcError as error:
                    codes.append(error.code())
                    unparsed.append("(the request as received)" in error.details())

        unparsed: list[bool] = []  # refused before the message was parsed: its bytes never copied
        send(20)  # the allocator's working set for such requests
        before = rss_mib(server.proc.pid)
        send(60)
        grown = rss_mib(server.proc.pid) - before
    print(f"\n60 refused 4 MiB requests: RSS {grown:+.0f} MiB")
    assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 80 and all(unparsed)
    shed = scrape(server.metrics_url)  # refused before they were read: under no model
    assert shed[("mhaserve_inference_request_shed_total", (("model", ""), ("reason", "memory"), ("version", "")))] == 80
    assert grown < 48, f"60 refused 4 MiB requests left {grown:.0f} MiB behind"


@pytest.mark.perf
def test_a_request_is_admitted_only_when_its_real_peak_fits_the_budget(start_server_process, small_model_dir):
    # The budget counted inputs and outputs only: ONNX Runtime's workspace (scores, masked scores, softmax,
    # projections) is several times that, so one admitted request could take several budgets.
    budget_mib = 64
    shapes = [(1, 512, True), (2, 512, False), (2, 512, True), (4, 512, False), (8, 512, False)]
    admitted, refused = {}, []
    server = start_server_process(small_model_dir, *LIMITS, "--max-inflight-bytes", str(budget_mib << 20))
    pid = server.proc.pid
    with Client(server.url) as client:
        for batch, length, weights in shapes:
            budget_once_idle(server)  # the arena of the run before is given back
            time.sleep(0.3)
            before = rss_mib(pid)
            reset_peak_rss(pid)
            try:
                client.infer(rand(batch, length, D), attn_weights=weights, timeout=60)
                admitted[(batch, length, weights)] = peak_rss_mib(pid) - before
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
                assert f"max_inflight_bytes={budget_mib << 20}" in error.details()
                refused.append((batch, length, weights))
    print(f"\nbudget {budget_mib} MiB: peaks {admitted} MiB; refused {refused}")
    assert (1, 512, True) in admitted and (8, 512, False) in refused
    assert all(peak < budget_mib for peak in admitted.values()), admitted


@pytest.mark.perf
def test_a_flood_stays_within_the_budget_and_memory_goes_back_when_idle(start_server_process, small_model_dir):
    budget_mib = 256
    query = rand(8, 256, D, seed=3)  # each answer holds 8 MiB of attention weights; each run ~40 MiB workspace
    server = start_server_process(small_model_dir, *LIMITS, "--max-inflight-bytes", str(budget_mib << 20))
    pid = server.proc.pid
    outcomes: list[str] = []

    def caller(calls: int):
        with Client(server.url) as client:
            for _ in range(calls):
                try:
                    answer = client.infer(query, timeout=60)
                    assert answer.attn_weights.shape == (8, 4, 256, 256)
                    outcomes.append("OK")
                except grpc.RpcError as error:
                    outcomes.append(error.code().name)

    def flood(calls: int) -> None:
        callers = [threading.Thread(target=caller, args=(calls,)) for _ in range(16)]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join()

    # A first, short flood sizes ONNX Runtime's arena and the allocator's pools for 16 answers at a time, once.
    # Over a baseline taken before any flood, a flood left 4-40 MiB, whether the server had fitted its run cost
    # (285 runs) or read it from the cache, and the next floods no more; over one taken after it, 3-23 MiB.
    flood(2)
    budget_once_idle(server)
    time.sleep(0.5)
    warm_outcomes, outcomes[:] = list(outcomes), []
    baseline = rss_mib(pid)
    reset_peak_rss(pid)
    flood(12)
    peak = peak_rss_mib(pid) - baseline
    held_when_idle = budget_once_idle(server)
    time.sleep(0.5)
    idle = rss_mib(pid) - baseline
    counts = inflight_and_counts(server)[1]
    print(f"\nflood of 192 x [8,256,{D}] with weights, c=16, budget {budget_mib} MiB: {outcomes.count('OK')} OK, "
          f"peak {peak:+.0f} MiB, idle {idle:+.0f} MiB over {baseline:.0f} MiB")  # fmt: skip
    assert set(outcomes) <= {"OK", "RESOURCE_EXHAUSTED"} and outcomes.count("OK") >= 48
    assert counts["grpc OK"] == outcomes.count("OK") + warm_outcomes.count("OK")
    assert peak < budget_mib, f"the flood took {peak:.0f} MiB over baseline under a {budget_mib} MiB budget"
    assert held_when_idle == 0 and idle < 32, f"{idle:.0f} MiB still held once idle"


def test_after_a_burst_the_budget_holds_what_the_runs_took_not_what_the_waiting_requests_might_have():
    # It kept the most workspace that waiting requests had ever needed together until the server was idle,
    # and a server under load is never idle: the mark only grew, while length-aware runs took less.
    budget = MemoryBudget(limit=100, workers=1, max_batch_size=8, waiting_share=0)
    waiting = [budget.admit(10, 1, 20) for _ in range(3)]  # 30 bytes, and runs that may need 60 together
    for token in waiting:  # length-aware: three runs of one request each, the arena keeps one run's 20
        budget.run_made(20)
        budget.run_ended(token)
        budget.release(10)
    assert budget.held == budget.kept_workspace == 20
    budget.admit(45, 1, 20)  # 45 + 60 would not fit; 45 + 20 does


def test_with_length_aware_batching_off_waiting_rows_count_as_padded_to_the_longest():
    # Counted unpadded, a long and a short request merged into one run took twice what the budget held.
    padded = MemoryBudget(limit=150, workers=1, max_batch_size=8, padded_runs=True, waiting_share=0)
    split = MemoryBudget(limit=150, workers=1, max_batch_size=8, waiting_share=0)
    for budget in (padded, split):
        budget.admit(0, 1, 100)  # a long request waiting
    split.admit(0, 1, 10)  # a short one beside it: 110 unpadded
    with pytest.raises(InflightBytesExceeded):
        padded.admit(0, 1, 10)  # padded to the long one: 200


def test_a_burst_of_honest_large_requests_waits_for_memory_and_every_one_is_answered(start_server, small_model_dir):
    # 32 callers at once, each request with its weights about 20 MiB of the budget (inputs, answer, workspace): the
    # budget admits a few at a time. They were refused RESOURCE_EXHAUSTED, most of them (tritonclient does not retry
    # it); now they wait for the memory the requests before them give back, and each is answered.
    server = start_server(small_model_dir, *LIMITS, "--max-inflight-bytes", str(96 << 20), "--inference-workers", "1")
    rng = np.random.default_rng(9)
    shapes = Shapes(D, 256, 256, max_batch=4, cross_fraction=0, mask_fraction=0, no_weights_fraction=0)
    calls = [make_call(rng, shapes) for _ in range(32)]
    waiting_seen, done = [], threading.Event()

    def watch() -> None:
        name = ("mhaserve_inference_memory_waiting_request_count", ())
        while not done.is_set():
            waiting_seen.append(scrape(server.metrics_url)[name])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        report = asyncio.run(burst(server.url, calls))
    finally:
        done.set()
        watcher.join()
    assert report.statuses == {"OK": 32}, {call.details for call in calls if call.status != "OK"}
    reference = Reference(small_model_dir)
    assert [p for call in calls if (p := mismatch(call, reference))] == []
    assert max(waiting_seen) >= 8, waiting_seen  # most of them waited for memory, not refused
    assert budget_once_idle(server) == 0


def test_requests_waiting_for_memory_count_as_queued_against_the_queue_size(start_server, small_model_dir):
    # Waiting for memory, a request is queued all but in name: a burst larger than --max-queue-size is refused
    # "queue is full" beyond it, as it was before memory waits, never for memory.
    args = ("--max-inflight-bytes", str(96 << 20), "--inference-workers", "1", "--max-queue-size", "4")
    server = start_server(small_model_dir, *LIMITS, *args)
    rng = np.random.default_rng(10)
    shapes = Shapes(D, 256, 256, max_batch=4, cross_fraction=0, mask_fraction=0, no_weights_fraction=0)
    calls = [make_call(rng, shapes) for _ in range(32)]
    report = asyncio.run(burst(server.url, calls))
    assert set(report.statuses) == {"OK", "RESOURCE_EXHAUSTED"}, report.statuses
    refusals = {call.details for call in calls if call.status == "RESOURCE_EXHAUSTED"}
    assert all("the request queue is full (4 requests waiting" in text for text in refusals), refusals
    assert budget_once_idle(server) == 0
