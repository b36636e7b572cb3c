"""Dynamic batching: concurrent requests merged into model runs, whatever their lengths.

Requests of different ``Lq``/``Lk`` share a run: queries and keys are zero-padded to the longest,
the padded keys are masked out, and each request's rows are cut back out of the results. A padded
query row has every key masked, which the model defines as zeros, so padding never makes NaN.

Padding costs compute: 16 requests of lengths 16..128 padded into one run took 1.6x the time of the
same requests run one by one (BENCHMARKS.md). So, length-aware, the queue is split into runs by a cost
model of this model on this machine (``run_cost.py``, fitted at warm-up): requests sorted by length,
cut where padding would cost more than another run's overhead. When what a free worker takes holds
more than one length, it looks further down the queue, up to TAKE_RUNS runs' worth of rows: with
more requests to choose from, the plan finds runs that are both full and of like lengths, where from
the head alone it could only choose between padding and small runs (each run still at most the batch
limit). The worker makes a take's runs one after another, the run holding the oldest request first,
and each run's answers leave as it ends. Runs of one take stay on one worker: on two cores one run
already uses both (ONNX Runtime's threads), and two at once would only share them. Equal lengths take
what they took before and stay one run. ``length_aware=False`` keeps the single padded run, for A/B
measurement.

Scheduling is greedy: whenever a worker is free it takes everything queued, up to the batch limit.
At low load a request runs at once (no added latency); under load requests pile up while a run is
in progress and the next run takes them all. ``max_queue_delay`` optionally holds a partial batch
back for more company, as Triton's ``max_queue_delay_microseconds`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import numpy as np

from mhaserve.contract.signature import ATTN_WEIGHTS, OUTPUT, SUMMARY_OUTPUT_NAMES, graph_outputs_for

from .errors import ErrorKind, RequestError
from .outputs import outputs_from_run
from .run_cost import RunCost, plan_runs
from .statistics import BatchResult
from .tensors import RunInputs
from .threads import WorkerBoard
from .tracing import RequestTrace, record_run

# A lone request's run is made on the event loop itself where the version allows its shape (``runs_here``): handed
# to an inference thread and back, a small run also waits for two thread wakes, while there is no other request
# to read meanwhile (BENCHMARKS.md, "Server settings that change speed"). Lone: it finds nothing queued or
# running, and no run ended within this long, so that requests coming back to back (many callers) keep to the
# inference threads, where reading the next overlaps the run.
QUIET_BEFORE_RUN_HERE_NS = 150_000


class QueueFull(RequestError):
    def __init__(self, limit: int, level: int = 0, set_by: str = ""):
        if level:  # its priority level's own share of the queue
            super().__init__(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"priority level {level}'s queue is full ({limit} of its requests waiting, its max_queue_size={limit}, "
                f"{set_by}); retry later",
                shed_by="queue_full",
            )
            return
        super().__init__(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"the request queue is full ({limit} requests waiting, limit max_queue_size={limit}); retry later",
            shed_by="queue_full",
        )


class DeadlineExpiredInQueue(RequestError):
    def __init__(self, waited_s: float):
        super().__init__(
            ErrorKind.DEADLINE_EXCEEDED,
            f"the deadline passed after {waited_s * 1000:.1f} ms in the queue; the request was not computed",
        )


@dataclass(frozen=True)
class QueueTimeout:
    """How long a request may wait in a model's queue before it is refused, and what set that: the model's
    (Triton's queue policy, ``default_timeout_microseconds``), or the request's own ``timeout`` parameter where
    the model lets a request shorten it (``allow_timeout_override``)."""

    seconds: float
    set_by: str

    def expired(self, waited_s: float) -> RequestError:
        # UNAVAILABLE, as Triton answers "Request timeout expired": the server was busy, another try may not be
        return RequestError(
            ErrorKind.UNAVAILABLE,
            f"the request waited {waited_s * 1000:.1f} ms in the queue, past its queue timeout of "
            f"{self.seconds * 1000:g} ms ({self.set_by}); it was not computed: the server is busy, retry",
            shed_by="queue_timeout",
        )


@dataclass(frozen=True)
class QueueTerms:
    """A request's terms in its model's queue, as the model's queue policy gives them (runtime.QueuePolicy): how
    long it may wait there, and its priority level (1 first; 0: the queue has no levels, first come first
    served)."""

    timeout: QueueTimeout | None = None
    priority: int = 0
    level_queue_size: int = 0  # its level's own bound on its requests waiting (0: none but the queue's)
    level_set_by: str = ""  # where that bound is set, for the refusal to name


NO_TERMS = QueueTerms()


@dataclass
class Merged:
    """Several requests as one set of model inputs, and where each request's rows lie."""

    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    mask: np.ndarray
    outputs: tuple[str, ...]  # the graph outputs to fetch
    parts: list[tuple[int, int, int, int]]  # (first row, batch, q_len, kv_len) per request

    @property
    def padding_ratio(self) -> float:
        """The share of the run's query-key pairs that are padding (0: none)."""
        rows, q_len, kv_len = self.query.shape[0], self.query.shape[1], self.key.shape[1]
        real = sum(batch * lq * lk for _, batch, lq, lk in self.parts)
        return 1.0 - real / (rows * q_len * kv_len)


def _is_unmasked(mask: np.ndarray) -> bool:
    """The placeholder for a request without a mask: [1, 1, 1, Lk], all True."""
    return mask.shape[0] == 1 and mask.shape[2] == 1 and bool(mask.all())


def merge(requests: list[RunInputs], summaries_graph: bool = False) -> Merged:
    """Stack requests along the batch axis, padding lengths to the longest (see the module doc); the run fetches
    the summaries graph's outputs where ``summaries_graph`` (the version has one) and no request asks for weights."""
    first = requests[0]
    outputs = graph_outputs_for(tuple(name for r in requests for name in r.outputs), summaries_graph)
    parts, row = [], 0
    for r in requests:
        parts.append((row, r.batch_size, r.query.shape[1], r.key.shape[1]))
        row += r.batch_size
    if len(requests) == 1:
        return Merged(first.query, first.key, first.value, first.mask, outputs, parts)

    q_len = max(p[2] for p in parts)
    kv_len = max(p[3] for p in parts)
    same_lengths = all(p[2] == q_len and p[3] == kv_len for p in parts)
    self_attention = all(r.key is r.query and r.value is r.query for r in requests)

    if same_lengths:
        query = np.concatenate([r.query for r in requests])
        key = query if self_attention else np.concatenate([r.key for r in requests])
        value = query if self_attention else np.concatenate([r.value for r in requests])
    else:
        d_model = first.query.shape[2]
        query = np.zeros((row, q_len, d_model), np.float32)
        key = np.zeros((row, kv_len, d_model), np.float32)
        value = key if self_attention else np.zeros((row, kv_len, d_model), np.float32)
        for r, (start, batch, lq, lk) in zip(requests, parts, strict=True):
            query[start : start + batch, :lq] = r.query
            key[start : start + batch, :lk] = r.key
            if not self_attention:
                value[start : start + batch, :lk] = r.value

    if same_lengths and all(_is_unmasked(r.mask) for r in requests):
        mask = first.mask  # nothing masked anywhere: the cheap broadcast mask serves all
    else:
        mask = np.zeros((row, 1, q_len, kv_len), dtype=bool)  # padding: may not attend
        for r, (start, batch, lq, lk) in zip(requests, parts, strict=True):
            mask[start : start + batch, :, :lq, :lk] = r.mask
    return Merged(query, key, value, mask, outputs, parts)


def split(
    merged: Merged, results: dict[str, np.ndarray], requests: list[RunInputs], computed_in: str = "float32"
) -> tuple[list[dict[str, np.ndarray] | None], list[RequestError | None]]:
    """Each request's own rows of the merged results, holding only the outputs it asked for, its weights shaped
    as it asked (shaping.shaped_weights); or, where the run overflowed on its rows, no answer and the error."""
    answers, errors = [], []
    for (start, batch, lq, lk), request in zip(merged.parts, requests, strict=True):
        rows = slice(start, start + batch)
        output = results[OUTPUT][rows, :lq] if OUTPUT in request.outputs else None
        weights = results[ATTN_WEIGHTS][rows, :, :lq, :lk] if ATTN_WEIGHTS in results else None
        summarised = {name: results[name][rows, :, :lq] for name in SUMMARY_OUTPUT_NAMES if name in results}
        answer, error = outputs_from_run(request.outputs, request.shaping, output, weights, computed_in, summarised)
        answers.append(answer)
        errors.append(error)
    return answers, errors


@dataclass
class _Pending:
    request: RunInputs
    future: asyncio.Future
    enqueued_ns: int
    deadline: float | None  # time.monotonic() by which its run must start; None: no deadline
    submitted_ns: int  # before it waited for memory, if it did: the wait counts as time queued
    trace: RequestTrace | None = None
    expired: Callable[[float], RequestError] = DeadlineExpiredInQueue  # its refusal then, given how long it waited
    priority: int = 0  # its level: it waits behind none of a later level (0: no levels)

    def refuse_expired(self) -> None:
        """Its deadline passed while it waited: refused, saying how long it waited."""
        self.future.set_exception(self.expired((time.perf_counter_ns() - self.submitted_ns) / 1e9))


@dataclass
class BatchedOutputs:
    """One request's outputs and where its time went (ns)."""

    outputs: dict[str, np.ndarray]
    queue_ns: int  # enqueued until its run started
    infer_ns: int  # its run: merge, model, split
    run_rows: int  # the rows of its run
    run_started_ns: int  # when its run started (perf_counter_ns)


RunModel = Callable[[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray], list[np.ndarray]]


# How far down the queue a take of mixed lengths looks, in runs of max_batch_size rows: four runs' worth
# finds runs of like lengths where one run's worth does not (measured when it was chosen); further would keep
# requests queued behind a longer take.
TAKE_RUNS = 4


def _lengths(pending: _Pending) -> tuple[int, int]:
    return pending.request.query.shape[1], pending.request.key.shape[1]


class Batcher:
    """Queue and scheduler; runs on the event loop, hands model runs to ``executor``.

    ``max_batch_size`` bounds the rows of one run (a request with that many rows runs alone);
    ``enabled=False`` runs every request on its own. ``on_batch`` sees every finished run. With a
    ``run_cost``, what a free worker takes is split into runs by length (see the module doc). A lone
    request whose (rows, Lq, Lk) ``runs_here`` allows is run on the event loop (QUIET_BEFORE_RUN_HERE_NS), marked
    on ``board`` in one of --workers.
    """

    def __init__(
        self,
        run_model: RunModel,
        executor: Executor,
        *,
        workers: int,
        max_batch_size: int,
        max_queue_size: int,
        max_queue_delay_s: float = 0.0,
        enabled: bool = True,
        on_batch: Callable[[BatchResult], None] | None = None,
        run_cost: RunCost | None = None,
        computed_in: str = "float32",
        runs_here: Callable[[int, int, int], bool] | None = None,
        board: WorkerBoard | None = None,
        summaries_graph: bool = False,
    ):
        self._run_model = run_model
        self.summaries_graph = summaries_graph  # the version has one: runs of summaries alone take it
        self.computed_in = computed_in  # the model's precision, named in an overflow's error
        self.run_cost = run_cost  # None: one padded run of everything taken (length-aware batching off)
        self._executor = executor
        self.workers = workers
        self._idle_workers = workers
        self.max_batch_size = max_batch_size
        self.max_queue_size = max_queue_size
        self._admitting: Counter[int] = Counter()  # by priority level: requests waiting for memory, counted as queued
        self.max_queue_delay_s = max_queue_delay_s
        self.enabled = enabled
        self._on_batch = on_batch
        self._queue: deque[_Pending] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._runs_here = runs_here
        self._board = board  # one of --workers: a run here is marked on it, as the inference threads' are
        self._last_run_ended_ns = 0

    @property
    def max_queue_delay_us(self) -> int:
        return round(self.max_queue_delay_s * 1e6)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def _check_room(self, terms: QueueTerms) -> None:
        """QueueFull where the queue (or the request's level of it), with the requests waiting for memory to join
        it, has no room for another."""
        if len(self._queue) + self._admitting.total() >= self.max_queue_size:
            raise QueueFull(self.max_queue_size)
        if terms.level_queue_size:
            waiting = self._admitting[terms.priority]
            waiting += sum(1 for pending in self._queue if pending.priority == terms.priority)
            if waiting >= terms.level_queue_size:
                raise QueueFull(terms.level_queue_size, terms.priority, terms.level_set_by)

    async def submit(
        self,
        request: RunInputs,
        timeout_s: float | None = None,
        trace: RequestTrace | None = None,
        terms: QueueTerms = NO_TERMS,
        admit: Callable[[], Awaitable[object]] | None = None,
    ):
        """The request's BatchedOutputs, once the run it was merged into is done.

        It waits ahead of every queued request of a later priority level than its ``terms``' (none of an earlier
        one or its own). Raises QueueFull at once when the queue is full, DeadlineExpiredInQueue when ``timeout_s``
        (the caller's deadline) passes before a worker takes it, and its terms' timeout's refusal when that passes
        first. ``admit`` takes the request's memory, waiting for it where it does not fit yet: meanwhile the request
        holds its place, counted as queued, and its wait counts against both. Cancelling the caller drops the
        request from the queue.
        """
        self._check_room(terms)
        now, submitted_ns = time.monotonic(), time.perf_counter_ns()
        if admit is not None:
            self._admitting[terms.priority] += 1
            try:
                await admit()
            finally:
                self._admitting[terms.priority] -= 1
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else now + timeout_s
        pending = _Pending(request, loop.create_future(), time.perf_counter_ns(), deadline, submitted_ns, trace)
        pending.priority = terms.priority
        timeout = terms.timeout
        if timeout is not None and (deadline is None or now + timeout.seconds < deadline):
            pending.deadline, pending.expired = now + timeout.seconds, timeout.expired
        if self._lone(pending):
            self._run_here([pending])
        else:
            self._enqueue(pending)
            self._dispatch()
        return await pending.future

    def _enqueue(self, pending: _Pending) -> None:
        """At the queue's end, or where levels are used, before the first waiting request of a later level."""
        if not self._queue or self._queue[-1].priority <= pending.priority:
            self._queue.append(pending)
            return
        place = next(i for i, waiting in enumerate(self._queue) if waiting.priority > pending.priority)
        self._queue.insert(place, pending)

    def _dispatch(self) -> None:
        while self._idle_workers and self._queue:
            if self._should_wait():
                return
            batch, runs = self._take_runs()
            if batch:
                self._idle_workers -= 1
                self._executor.submit(self._run_all, runs, batch, asyncio.get_running_loop())

    def _lone(self, pending: _Pending) -> bool:
        """Whether a request that comes now is run here, on the event loop: nothing queued or running, no run
        ended within QUIET_BEFORE_RUN_HERE_NS, no queue delay to wait for company, and ``runs_here`` allows its
        shape."""
        if self._runs_here is None or self._queue or self._idle_workers < self.workers or self.max_queue_delay_s > 0:
            return False
        if time.perf_counter_ns() - self._last_run_ended_ns < QUIET_BEFORE_RUN_HERE_NS:
            return False
        if pending.deadline is not None and time.monotonic() >= pending.deadline:
            return False  # the queue refuses it
        return self._runs_here(pending.request.batch_size, *_lengths(pending))

    def _run_here(self, batch: list[_Pending]) -> None:
        try:
            with self._board.running() if self._board is not None else contextlib.nullcontext():
                result = self._run(batch)
        except Exception as error:
            self._deliver(batch, None, error)
        else:
            self._deliver(batch, result, None)

    def _should_wait(self) -> bool:
        """With a queue delay, a partial batch waits until its oldest request has waited that long; a request
        whose deadline comes first is refused then, not at the delay's end."""
        if not self.enabled or self.max_queue_delay_s <= 0:
            return False
        earliest = self._refuse_expired()
        if not self._queue:
            return False
        rows = sum(p.request.batch_size for p in self._queue if not p.future.done())
        if rows >= self.max_batch_size:
            return False
        waited = (time.perf_counter_ns() - self._queue[0].enqueued_ns) / 1e9
        if waited >= self.max_queue_delay_s:
            return False
        wake_in = self.max_queue_delay_s - waited
        if earliest is not None:
            wake_in = min(wake_in, earliest - time.monotonic())
        loop = asyncio.get_running_loop()
        if self._timer is not None and self._timer.when() > loop.time() + wake_in:
            self._timer.cancel()  # a request's deadline comes before the delay's end
            self._timer = None
        if self._timer is None:
            self._timer = loop.call_later(max(wake_in, 0.0), self._on_timer)
        return True

    def _refuse_expired(self) -> float | None:
        """Requests waiting past their deadline leave the queue, refused; the earliest deadline of those left."""
        now, earliest, expired = time.monotonic(), None, []
        for pending in self._queue:
            if pending.deadline is None or pending.future.done():
                continue
            if now >= pending.deadline:
                expired.append(pending)
            elif earliest is None or pending.deadline < earliest:
                earliest = pending.deadline
        if expired:  # the queue is made again only when one leaves it
            for pending in expired:
                pending.refuse_expired()
            self._queue = deque(pending for pending in self._queue if not pending.future.done())
        return earliest

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _take(self, max_rows: int) -> list[_Pending]:
        """Pop the next batch: skip cancelled requests, fail expired ones, stop at ``max_rows``."""
        batch, rows = [], 0
        now = time.monotonic()
        while self._queue:
            pending = self._queue[0]
            if pending.future.done():  # the caller was cancelled (client gone or gave up)
                self._queue.popleft()
                continue
            if pending.deadline is not None and now >= pending.deadline:
                self._queue.popleft()
                pending.refuse_expired()
                continue
            if batch and (not self.enabled or rows + pending.request.batch_size > max_rows):
                break
            self._queue.popleft()
            batch.append(pending)
            rows += pending.request.batch_size
        return batch

    def _take_runs(self) -> tuple[list[_Pending], list[list[_Pending]]]:
        """What a free worker takes, and the runs to make of it, the oldest request's run first (module doc)."""
        batch = self._take(self.max_batch_size)
        if self.run_cost is None or len({_lengths(p) for p in batch}) < 2:
            return batch, [batch]  # padded, or one length: nothing to gain by splitting, no plan to pay for
        batch += self._take(self.max_batch_size * (TAKE_RUNS - 1))
        shapes = [(p.request.batch_size, *_lengths(p)) for p in batch]
        runs = [[batch[i] for i in sorted(run)] for run in plan_runs(shapes, self.run_cost, self.max_batch_size)]
        # Oldest first: a take spans several runs' worth of the queue, and in this order the requests
        # that have waited longest leave first (cheapest first left the longest requests of every take
        # to its end, and raised p99: BENCHMARKS.md, "Batching across lengths").
        return batch, sorted(runs, key=lambda run: run[0].enqueued_ns)

    def _run_all(self, runs: list[list[_Pending]], batch: list[_Pending], loop: asyncio.AbstractEventLoop) -> None:
        """In a worker thread: the take's runs one after another, each run's answers sent as it ends, then the
        worker freed by a wake of the event loop of its own. (Freed in the same callback as the last answers, the
        next take came sooner and smaller under load, and fewer requests a second: measured when it was
        chosen.)"""
        try:
            for run in runs:
                try:
                    result = self._run(run)
                except Exception as error:  # this run's requests fail; the take's other runs go on
                    loop.call_soon_threadsafe(self._deliver, run, None, error)
                else:
                    loop.call_soon_threadsafe(self._deliver, run, result, None)
        except BaseException as error:  # the worker itself failed: what it took must not wait forever
            loop.call_soon_threadsafe(self._finished, batch, error)
            raise
        loop.call_soon_threadsafe(self._finished, batch)

    def _run(self, batch: list[_Pending]) -> BatchResult:
        """In a worker thread (a lone request's on the event loop): merge, run the model, split."""
        started = time.perf_counter_ns()
        requests = [p.request for p in batch]
        merged = merge(requests, self.summaries_graph)
        merged_at = time.perf_counter_ns()
        arrays = self._run_model(merged.outputs, merged.query, merged.key, merged.value, merged.mask)
        ran_at = time.perf_counter_ns()
        answers, errors = split(merged, dict(zip(merged.outputs, arrays, strict=True)), requests, self.computed_in)
        finished = time.perf_counter_ns()
        rows = merged.query.shape[0]
        return BatchResult(
            answers,
            errors,
            rows,
            merged.query.shape[1],
            merged.key.shape[1],
            merged.padding_ratio,
            started,
            finished,
            merged_at - started,
            ran_at - merged_at,
            finished - ran_at,
        )

    def _deliver(self, run: list[_Pending], result: BatchResult | None, error: Exception | None) -> None:
        """A run's answers to their callers."""
        self._last_run_ended_ns = time.perf_counter_ns()
        if result is not None and self._on_batch is not None:
            self._on_batch(result)
        if result is not None:
            traces = [p.trace for p in run if p.trace is not None]
            if traces:
                record_run(result, [p.request for p in run], traces)
        for index, pending in enumerate(run):
            if pending.future.done():
                continue
            if error is not None or result.errors[index] is not None:
                pending.future.set_exception(error or result.errors[index])
            else:
                queue_ns = result.started_ns - pending.enqueued_ns
                infer_ns = result.finished_ns - result.started_ns
                pending.future.set_result(
                    BatchedOutputs(result.answers[index], queue_ns, infer_ns, result.batch_size, result.started_ns)
                )

    def _finished(self, batch: list[_Pending], error: BaseException | None = None) -> None:
        """The take is over (its answers were delivered as each run ended): free the worker, take more."""
        self._idle_workers += 1
        for pending in batch:  # only if the worker itself failed can a future still be open here
            if error is not None and not pending.future.done():
                pending.future.set_exception(error)
        self._dispatch()
