"""Request accounting for the whole process: the memory budget every model's requests share (admitted,
released, and the arenas given back once idle), and each request's fate in the statistics, the metrics and
the stop line's counts."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TYPE_CHECKING

from .errors import ErrorKind, RequestError
from .logs import access_line
from .malloc import release_free_memory
from .memory import MemoryBudget, answer_bytes, input_bytes, request_workspace_bytes
from .metrics import Metrics
from .registry import ServedModel
from .runtime import Runtime
from .statistics import RequestTiming

if TYPE_CHECKING:
    from mhaserve.contract.signature import ModelSignature

    from .batcher import QueueTimeout
    from .calls import CallRecord
    from .tensors import RunInputs

log = logging.getLogger("mhaserve.server")

# After a burst, ONNX Runtime's arenas and the heap keep the burst's peak; once nothing has been in flight
# for this long, they are given back (the next large run pays for growing them again, so not at once).
IDLE_RELEASE_S = 2.0
# Request bodies received and dropped (refused ones too) leave their pages in the heap, which glibc keeps up
# to its raised trim threshold (malloc.tune_malloc); past this many bytes the idle release gives them back.
# Low, because a gRPC message takes several times its size in gRPC's buffers while it is received
# (BENCHMARKS.md, "Hostile clients").
RECEIVED_BYTES_BEFORE_TRIM = 8 << 20
# Received bytes refused unadmitted during a burst, past which the heap is trimmed at once, not only once idle: each
# of gRPC's threads receives into an arena of its own, which keeps what it freed, so a burst of large refused
# messages would otherwise hold about one message per arena. Only refused bytes count: under steady load the pages
# admitted requests free are the next requests'.
RECEIVED_BYTES_BEFORE_BUSY_TRIM = 256 << 20


class Receipt:
    """One request's bytes as its transport receives them: counted against the budget until the request is
    admitted (its inputs are counted then) or refused, and refused (RESOURCE_EXHAUSTED) before they are read
    (HTTP) or parsed (gRPC, whose core receives a message whole before any handler runs)."""

    def __init__(self, accounting: RequestAccounting):
        self._accounting = accounting
        self.held = 0

    def add(self, nbytes: int) -> None:
        """``nbytes`` more are about to be read (or were read just now), or the request is refused."""
        self._accounting.budget.take(nbytes, "the request as received")
        self.held += nbytes

    def add_received(self, nbytes: int) -> None:
        """``nbytes`` are in memory already (a gRPC message): counted as ``add`` counts them; refused, their pages
        are still given back once the server is idle."""
        try:
            self.add(nbytes)
        except RequestError:
            self._accounting.received_dropped(nbytes)
            raise

    def close(self) -> None:
        """The request was refused, or ended: its received bytes leave the budget (once)."""
        if self.held:
            self._accounting.received_released(self.held)
            self.held = 0

    def handed_over(self) -> None:
        """The request was admitted, its received bytes given back in the budget for its inputs."""
        self._accounting.received_handed_over(self.held)
        self.held = 0


class CallMemory:
    """One call's bytes in the budget, from receipt to delivery: its request as received (``receipt``) until it is
    admitted; then its inputs, its answer and its run's workspace: the workspace until its run ends, the inputs
    until the answer is encoded, the answer until it is sent (``reserved`` then, for the call's settlement)."""

    def __init__(self, accounting: RequestAccounting):
        self._accounting = accounting
        self.receipt = Receipt(accounting)
        self.reserved = 0  # in the budget, received bytes apart
        self._answer = 0  # of which the answer's
        self._waiting = None  # its run's workspace, until the run ends

    async def admit(
        self,
        attention: RunInputs,
        signature: ModelSignature,
        timeout_s: float | None,
        queue_timeout: QueueTimeout | None = None,
    ) -> None:
        """Its decoded inputs and its answer taken, with its run's workspace, once they fit (waiting for memory up
        to ``timeout_s``, what is left of its deadline, and its model's ``queue_timeout``), or refused; from here its
        inputs count as decoded, no longer as received."""
        inputs, answer = input_bytes(attention), answer_bytes(attention, signature.num_heads, signature.precision)
        workspace = request_workspace_bytes(attention, signature.num_heads)
        budget, share = self._accounting.budget, (inputs + answer, attention.batch_size, workspace, self.receipt.held)
        admitted = budget.admit_now(*share)
        if admitted is None:
            started = time.monotonic()
            queue_first = queue_timeout is not None and (timeout_s is None or queue_timeout.seconds < timeout_s)
            try:
                admitted = await asyncio.wait_for(
                    budget.admit_in_turn(*share), queue_timeout.seconds if queue_first else timeout_s
                )
            except asyncio.TimeoutError:
                waited_s = time.monotonic() - started
                if queue_first:
                    raise queue_timeout.expired(waited_s) from None
                raise RequestError(
                    ErrorKind.DEADLINE_EXCEEDED,
                    f"the deadline passed after {waited_s * 1000:.1f} ms waiting for memory (--max-inflight-bytes); "
                    "the request was not computed",
                ) from None
        self._waiting = admitted
        self.receipt.handed_over()
        self.reserved, self._answer = inputs + answer, answer  # (a refusal took nothing)

    def run_ended(self) -> None:
        self._accounting.budget.run_ended(self._waiting)
        self._waiting = None

    def answer_encoded(self) -> None:
        """The inputs go; the answer stays until it is sent."""
        self._accounting.budget.release(self.reserved - self._answer)
        self.reserved = self._answer

    def call_ended(self) -> None:
        """What a call refused while or after it was received, or expired or cancelled before its run ended,
        still held goes."""
        self.receipt.close()
        self.run_ended()


class RequestAccounting:
    def __init__(
        self, budget: MemoryBudget, metrics: Metrics, executor: Executor, runtimes: Callable[[], list[Runtime]]
    ):
        self.budget = budget
        self.metrics = metrics
        self._executor = executor  # the idle release runs where the runs do, never beside one
        self._runtimes = runtimes  # the runtimes whose graphs' arenas an idle release empties
        # Armed when the budget becomes idle and left armed by the next request (a timer armed and cancelled for
        # each request cost the event loop more): when it fires, the release waits for IDLE_RELEASE_S since the
        # budget last became idle, and for the next idle spell if it is busy.
        self._idle_release: asyncio.TimerHandle | None = None
        self._idle_since = 0.0  # when the budget last became idle, on the loop's clock
        self._received_since_release = 0  # request bodies received and freed since the last idle release
        self._received_since_trim = 0  # ... and since the heap was last trimmed
        self._trimming = None  # the heap's trim under way during a burst
        self._giving_back = None  # the idle release under way
        self.requests_in_flight = 0  # inference calls inside a handler (event loop only)
        self.requests_being_read = 0  # gRPC requests still arriving, before their call opens (event loop only)
        self.outcomes: Counter[str] = Counter()  # inference calls by final status since start

    def quiet(self) -> bool:
        """No inference call but the one asking is in the server, none is arriving, and no memory is being given
        back on the inference threads (which a run beside it would race)."""
        return (
            self.requests_in_flight <= 1
            and not self.requests_being_read
            and self._trimming is None
            and self._giving_back is None
        )

    def settle(
        self, call: CallRecord, reserved: int, delivered: bool, status: str = "", *, freed: bool = True
    ) -> Callable[[], None] | None:
        """A request's end: its status is recorded (and its access log line written) and its memory leaves the
        budget; or, ``freed`` False (the transport still holds the answer), the function that releases it
        later."""
        if freed:
            self._release(reserved)
            release = None
        else:
            release = functools.partial(self._release, reserved)
        status = status or ("OK" if delivered else "CANCELLED")
        if call.forwarded:  # the process that answered it counts it and writes its access line
            self.outcomes[status] += 1
            self.metrics.step_forwarded(status)
            return release
        self.record(call.served, status, call.rows, call.timing, call.protocol, call.shed_by)
        served = call.served
        trace_id = ""
        if call.trace is not None:
            trace_id = call.trace.trace_id
            call.trace.finish(call, status, time.perf_counter_ns())
        access_line(
            call.protocol, served.signature.name if served else "", served.signature.version if served else "", status,
            call.request_id, call.rows, call.bytes_in, call.bytes_out, call.timing, trace_id, call.peer, call.caller,
        )  # fmt: skip
        return release

    def _release(self, reserved: int) -> None:
        self.budget.release(reserved)
        self._released()

    def _released(self) -> None:
        """Memory left the budget: the idle release is armed where the budget became idle."""
        holding = self.budget.kept_workspace or self._received_since_release >= RECEIVED_BYTES_BEFORE_TRIM
        if self.budget.idle:
            loop = asyncio.get_running_loop()
            self._idle_since = loop.time()
            if self._idle_release is None and holding:
                self._idle_release = loop.call_at(self._idle_since + IDLE_RELEASE_S, self._idle_release_due)

    def received_released(self, nbytes: int) -> None:
        """A request body's bytes, counted while it was received, leave the budget (admitted, the request's
        inputs are counted instead; refused, they are freed)."""
        self._received_since_release += nbytes
        self.budget.release_received(nbytes)
        self._released()

    def received_handed_over(self, nbytes: int) -> None:
        """A request body's bytes were given back in the budget for the request's inputs, admitted."""
        self._received_since_release += nbytes

    def received_dropped(self, nbytes: int) -> None:
        """A request received (whole, or in part and abandoned) and refused before it was counted: its pages are
        given back once idle, or at once in a burst of them."""
        self._received_since_release += nbytes
        self._received_since_trim += nbytes
        if self._received_since_trim >= RECEIVED_BYTES_BEFORE_BUSY_TRIM and self._trimming is None:
            self._received_since_trim = 0
            self._trimming = self._executor.submit(release_free_memory)
            self._trimming.add_done_callback(self._trimmed)
        self._released()

    def _trimmed(self, _) -> None:
        self._trimming = None  # a thread's callback: a plain assignment, read on the loop

    def _idle_release_due(self) -> None:
        """The release, once the budget has been idle for IDLE_RELEASE_S."""
        self._idle_release = None
        if not self.budget.idle:  # armed again when it next becomes idle
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._idle_since + IDLE_RELEASE_S:  # busy meanwhile, idle again since
            self._idle_release = loop.call_at(self._idle_since + IDLE_RELEASE_S, self._idle_release_due)
            return
        self._release_idle_memory()

    def _release_idle_memory(self) -> None:
        """Give the arenas' and the heap's free memory back, if idle."""
        if not self.budget.idle:
            return
        runtimes = self._runtimes()

        self._received_since_release = 0

        def release() -> None:
            for runtime in runtimes:
                runtime.release_memory()
            release_free_memory()

        self._giving_back = released = asyncio.wrap_future(self._executor.submit(release))
        released.add_done_callback(self._given_back)

    def _given_back(self, _) -> None:
        self._giving_back = None
        self.budget.workspace_given_back()

    def record(
        self,
        served: ServedModel | None,
        status: str,
        rows: int,
        timing: RequestTiming,
        protocol: str = "grpc",
        shed_by: str = "",
    ) -> None:
        """One request's fate, for the statistics RPC, the metrics endpoint and the stop line. A request that
        named no served model is counted under empty labels, never under a name it made up; ``shed_by``, the
        server's bound that refused it, is counted by the version it would have run on."""
        self.outcomes[status] += 1
        if served is None:
            self.metrics.request_done("", "", status, protocol, shed_by)
            return
        if status == "OK":
            served.stats.record_success(rows, timing)
        else:
            served.stats.record_failure(timing.total_ns)
        seconds = timing.total_ns / 1e9, timing.queue_ns / 1e9, timing.infer_ns / 1e9
        served.metrics.request_done(status, protocol, rows, *seconds, shed_by=shed_by)

    def refused_while_arriving(self, refusal: RequestError) -> None:
        """A gRPC request refused before its call opened (still arriving, or never whole): counted under no model,
        as a request that named none, for the metrics and the stop line."""
        status = refusal.kind.name
        self.outcomes[status] += 1
        self.metrics.request_done("", "", status, "grpc", refusal.shed_by)
        log.debug("a grpc request refused %s while it arrived: %s", status, refusal.message)

    def record_unauthenticated(self, method: str) -> None:
        log.debug("refused %s: missing or wrong bearer token", method)
        self.metrics.unauthenticated()
