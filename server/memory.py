"""What requests cost the process's memory, and the in-flight budget (``--max-inflight-bytes``) that bounds it.

Measured per shape with ``benchmarks/bench_memory.py`` (BENCHMARKS.md, "Hostile clients"): one request's
peak RSS over an idle server is several times its inputs and outputs, because ONNX Runtime's run needs
workspace of its own (the scores, the masked scores and the softmax, each [B, h, Lq, Lk] float32, and the
projections), and the answer is copied while it is encoded and sent. So the budget counts:
- per request, its inputs (until its run ends) and its answer (until the transport has written it);
- the run workspace, once: queued requests are merged into a run whose workspace is about the sum of
  theirs, and ONNX Runtime's arena keeps the largest run's space for the next ones. So the budget holds
  the largest runs made (one per worker) until the server has been idle for a while and the arena is
  given back (``DataPlane``'s idle release), or, while requests wait, what their runs may need if more.

What the arena keeps is what runs really took, not what waiting requests once might have needed: the
most of the latter, kept until idle, only grew under sustained load (a loaded server is never idle).
Length-aware runs take less than their take's sum; padded runs take more (every row padded to the
longest), which is why, with length-aware batching off, waiting rows count as padded.

A request that does not fit yet waits its turn for the memory that the requests admitted give back, as a queue would
hold it (the budget bounds memory, not how many may wait: an honest caller is not refused for a busy server). What
it holds meanwhile, its request as received, is counted. While requests admitted wait for their runs or run, the
requests admitted hold at most what WAITING_SHARE leaves, so that requests arriving have room to be received and to
wait; a request larger than that runs alone. A request is refused only where waiting cannot help: it is larger than
the budget, no memory is coming back, or those waiting already hold their share. Memory comes back while a request
admitted waits for its run or runs; once only answers being written hold it, for DELIVERY_GRACE_S at most (a client
that does not read its answers holds their memory until its connection goes, and must not hold the line of everyone
else's requests behind it).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
from dataclasses import dataclass

from .errors import ErrorKind, RequestError
from .shaping import ranking_bytes, weights_answer_bytes
from .tensors import RunInputs, weights_dtype

F32 = 4
# Fitted to bench_memory.py's per-shape peaks (512/8 model, CPU arena), rounded up; see BENCHMARKS.md.
WORKSPACE_PER_SCORE = 4 * F32  # bytes per query-key pair and head: scores, masked, softmax, arena rounding
WORKSPACE_PER_TOKEN = 4 * F32  # bytes per (row, position, feature) of query, key and value: projections
INPUT_COPIES = 2  # the message as received, and the arrays decoded from it
ANSWER_COPIES = 2  # the encoded answer, and the transport's copy while it is written
# Of the budget, what is kept for requests as received (arriving, or waiting for memory) while requests admitted wait
# for their runs or run: the requests admitted hold the rest, so that a burst of large requests is received and waits
# in turn rather than being refused for the memory the first of them took.
WAITING_SHARE = 0.5
# How long the requests waiting wait for memory that only answers being written hold (none of the requests admitted
# waiting for a run): honest clients read theirs within it; past it, those that still do not fit are refused.
DELIVERY_GRACE_S = 0.5


def run_workspace_bytes(batch: int, q_len: int, kv_len: int, d_model: int, num_heads: int) -> int:
    """ONNX Runtime's own memory for one run of this shape, outputs included."""
    return (
        WORKSPACE_PER_SCORE * batch * num_heads * q_len * kv_len
        + WORKSPACE_PER_TOKEN * batch * (q_len + 2 * kv_len) * d_model
    )


def answer_bytes(request: RunInputs, num_heads: int, precision: str = "fp32") -> int:
    """What the answer holds from its encoding until it is written: the outputs asked for, as copied
    (the weights in the datatype the model's ``precision`` returns them in, or the request asked for)."""
    batch, q_len, d_model = request.query.shape
    kv_len = request.kv_len
    outputs = F32 * batch * q_len * d_model  # output is always returned
    outputs += weights_answer_bytes(
        request.shaping, request.outputs, batch, num_heads, q_len, kv_len, weights_dtype(precision).itemsize
    )
    return ANSWER_COPIES * outputs


def input_bytes(request: RunInputs) -> int:
    """The decoded inputs (self-attention shares one array), as received and as decoded."""
    inputs = {id(a): a.nbytes for a in (request.query, request.key, request.value, request.mask)}
    return INPUT_COPIES * sum(inputs.values())


def request_workspace_bytes(request: RunInputs, num_heads: int) -> int:
    """Its share of a run's workspace, and what ranking its weights (top-k, top-p) holds after the run."""
    batch, q_len, d_model = request.query.shape
    kv_len = request.kv_len
    ranking = ranking_bytes(request.shaping, batch, num_heads, q_len, kv_len)
    return run_workspace_bytes(batch, q_len, kv_len, d_model, num_heads) + ranking


class InflightBytesExceeded(RequestError):
    def __init__(self, held: int, needed: int, limit: int, what: str = "inputs, answer, run workspace"):
        super().__init__(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"this request needs {needed} bytes ({what}) while requests in flight hold "
            f"{held}; together over the limit max_inflight_bytes={limit}; retry later",
            shed_by="memory",
        )


class WaitingLineFull(RequestError):
    def __init__(self, waiting: int, held: int, limit: int, share: int):
        super().__init__(
            ErrorKind.RESOURCE_EXHAUSTED,
            f"the server is busy: this request, as received, would join the {waiting} waiting for memory, which hold "
            f"{held} bytes, over their share of max_inflight_bytes={limit} ({share} bytes); retry later",
            shed_by="memory",
        )


@dataclass(eq=False)
class _Waiting:
    """A request waiting for memory: what it will take, what it holds as received, and its admission."""

    request_bytes: int
    rows: int
    workspace: int
    received: int
    admitted: asyncio.Future


class MemoryBudget:
    """The bytes requests hold (``held``) against ``limit``; event loop only.

    The workspace counted is what the runs that can happen at once may need: never more than the requests
    waiting for a run need together, nor more than ``workers`` runs can take (each at most
    ``max_batch_size`` rows, at the largest workspace per row waiting; with batching off, one request each).
    With ``padded_runs`` (length-aware batching off) a run pads every row to its longest request, so the
    rows waiting count at the largest workspace per row. The workspace held is the larger of that and
    what the arenas keep from the runs made (``run_made``).
    """

    def __init__(
        self,
        limit: int,
        workers: int = 1,
        max_batch_size: int | None = None,
        *,
        padded_runs: bool = False,
        kept_share: float = 1.0,
        waiting_share: float = WAITING_SHARE,
    ):
        self.limit = limit
        # while requests admitted wait for their runs or run, what the requests admitted may hold; the rest is for
        # requests as received, those waiting for memory at most the rest (0: none waits, each refused at once)
        self.waiting_limit = int(waiting_share * limit)
        self.admitted_limit = limit - self.waiting_limit
        self.kept_share = kept_share  # of ``limit``, what state kept between requests may hold together
        self.kept_limit = int(kept_share * limit)
        self.workers = workers
        self.max_batch_size = max_batch_size  # None: batching off, one request per run
        self.padded_runs = padded_runs  # every waiting request may be padded to the longest (length-aware off)
        self.request_bytes = 0  # inputs and answers of the requests in flight
        self.kept_bytes = 0  # what outlives requests (sequences' keys and values): held, yet no request is in flight
        self._waiting: dict[object, tuple[int, int]] = {}  # token -> (rows, workspace), until its run ends
        # The waiting requests' sums, and their workspaces per row, largest first (entries of requests whose run
        # ended leave as they reach the top): what their runs may need, kept as they come and go rather than
        # summed over every one of them at each request.
        self._waiting_rows = self._waiting_workspace = 0
        self._per_row: list[tuple[float, int, object]] = []  # (-workspace per row, order, token): a heap
        self._order = itertools.count()
        self._largest_runs: list[int] = []  # the workers' largest run workspaces since the arenas were given back
        self.received_bytes = 0  # of ``request_bytes``, those of requests as received, not yet admitted
        self._line: collections.deque[_Waiting] = collections.deque()  # requests waiting for memory, in turn
        self._line_received = 0  # what they hold as received
        self._delivery_wait: asyncio.TimerHandle | None = None  # armed while the line waits on answers being written
        self._delivery_stalled = False  # ... and the grace passed with no memory given back

    @property
    def kept_workspace(self) -> int:
        """What ONNX Runtime's arenas keep: the largest runs made since they were given back, one per worker."""
        return sum(self._largest_runs)

    @property
    def held(self) -> int:
        return self.request_bytes + self.kept_bytes + max(self.kept_workspace, self._runs_may_need())

    @property
    def idle(self) -> bool:
        """No request in flight (what is kept between them, a live sequence's cache, does not count): the arenas'
        and the heap's free memory may be given back."""
        return self.request_bytes == 0 and not self._waiting

    def _runs_may_need(self, joining: tuple[int, int] | None = None) -> int:
        """What the runs of the requests waiting, and of ``joining`` (rows, workspace) if given, may need."""
        rows, total = self._waiting_rows, self._waiting_workspace
        if joining is not None:
            rows, total = rows + joining[0], total + joining[1]
        if not rows:
            return 0
        if self.max_batch_size is None:  # a run each: the largest, as many as run at once
            waiting = [workspace for _, workspace in self._waiting.values()] + ([joining[1]] if joining else [])
            return min(total, sum(heapq.nlargest(self.workers, waiting)))
        per_row = self._largest_per_row()
        if joining is not None:
            per_row = max(per_row, joining[1] / joining[0])
        if self.padded_runs:  # one run pads all it takes to the longest: as if every row were that long
            return int(per_row * min(rows, self.max_batch_size * self.workers))
        return min(total, int(per_row * self.max_batch_size * self.workers))

    def _largest_per_row(self) -> float:
        heap = self._per_row
        while heap and heap[0][2] not in self._waiting:
            heapq.heappop(heap)
        return -heap[0][0] if heap else 0.0

    @property
    def waiting_for_memory(self) -> int:
        """Requests waiting for memory."""
        return len(self._line)

    def _fits(self, request_bytes: int, rows: int, workspace: int, received: int) -> bool:
        """Whether a request's share fits, its ``received`` bytes given back for it: within the budget, and, while
        a request admitted waits for its run or runs, within what WAITING_SHARE leaves the requests admitted."""
        workspaces = max(self.kept_workspace, self._runs_may_need((rows, workspace)))
        admitted = self.request_bytes - self.received_bytes + self.kept_bytes + request_bytes + workspaces
        if admitted + self.received_bytes - received > self.limit:
            return False
        return admitted <= self.admitted_limit or not self._waiting

    def admit(self, request_bytes: int, rows: int, workspace: int, received: int = 0) -> object:
        """Take a request's share, its ``received`` bytes (counted by ``take`` as it arrived) given back for it,
        or refuse it (RESOURCE_EXHAUSTED) when that would go over the limit; the token it returns is given to
        ``run_ended``."""
        if not self._fits(request_bytes, rows, workspace, received):
            raise InflightBytesExceeded(self.held, request_bytes + workspace, self.limit)
        return self._take_share(request_bytes, rows, workspace, received)

    def admit_now(self, request_bytes: int, rows: int, workspace: int, received: int = 0) -> object | None:
        """As ``admit`` where the request fits now and no other waits for memory before it; else None."""
        if not self._line and self._fits(request_bytes, rows, workspace, received):
            return self._take_share(request_bytes, rows, workspace, received)
        return None

    async def admit_in_turn(self, request_bytes: int, rows: int, workspace: int, received: int = 0) -> object:
        """As ``admit``, but a request that does not fit yet waits for the memory the requests admitted give back,
        after those waiting before it; refused at once only where waiting cannot help (the module's docstring)."""
        admitted = self.admit_now(request_bytes, rows, workspace, received)
        if admitted is not None:
            return admitted
        if request_bytes + self.kept_bytes + workspace > self.limit or not self._memory_coming_back():
            raise InflightBytesExceeded(self.held, request_bytes + workspace, self.limit)
        if self._line_received + received > self.waiting_limit:
            raise WaitingLineFull(len(self._line), self._line_received, self.limit, self.waiting_limit)
        entry = _Waiting(request_bytes, rows, workspace, received, asyncio.get_running_loop().create_future())
        self._line.append(entry)
        self._line_received += received
        self._admit_waiting()  # the grace for answers being written armed, where only they hold the memory
        try:
            return await entry.admitted
        except asyncio.CancelledError:  # its caller gone, or its deadline passed
            if entry in self._line:
                self._line.remove(entry)
                self._line_received -= received
            elif entry.admitted.done() and not entry.admitted.cancelled() and entry.admitted.exception() is None:
                # admitted as it was cancelled: the share goes back, the bytes as received stay its receipt's
                self.run_ended(entry.admitted.result())
                self.request_bytes -= request_bytes - received
                self.received_bytes += received
            self._admit_waiting()
            raise

    def _memory_coming_back(self) -> bool:
        """Whether the requests waiting may wait: a request admitted waits for its run or runs, or answers being
        written hold memory and the grace for them has not passed."""
        return bool(self._waiting) or (self.request_bytes > self.received_bytes and not self._delivery_stalled)

    def _given_back(self) -> None:
        """Memory came back: the grace for answers being written starts again, and those waiting are admitted."""
        self._delivery_stalled = False
        if self._delivery_wait is not None:
            self._delivery_wait.cancel()
            self._delivery_wait = None
        self._admit_waiting()

    def _grace_passed(self) -> None:
        self._delivery_wait = None
        self._delivery_stalled = True
        self._admit_waiting()

    def _admit_waiting(self) -> None:
        """Admit the requests waiting, in turn, while they fit; refuse the first where no memory is coming back."""
        while self._line:
            entry = self._line[0]
            if entry.admitted.done():  # cancelled
                pass
            elif self._fits(entry.request_bytes, entry.rows, entry.workspace, entry.received):
                share = self._take_share(entry.request_bytes, entry.rows, entry.workspace, entry.received)
                entry.admitted.set_result(share)
            elif not self._memory_coming_back():
                refusal = InflightBytesExceeded(self.held, entry.request_bytes + entry.workspace, self.limit)
                entry.admitted.set_exception(refusal)
            else:
                if not self._waiting and self._delivery_wait is None:  # only answers being written hold it
                    loop = asyncio.get_running_loop()
                    self._delivery_wait = loop.call_later(DELIVERY_GRACE_S, self._grace_passed)
                return
            self._line.popleft()
            self._line_received -= entry.received

    def _take_share(self, request_bytes: int, rows: int, workspace: int, received: int) -> object:
        self.request_bytes -= received
        self.received_bytes -= received
        token = object()
        self._waiting[token] = (rows, workspace)
        self._waiting_rows += rows
        self._waiting_workspace += workspace
        if len(self._per_row) > 2 * len(self._waiting) + 64:  # ended entries piled up below a long wait
            self._per_row = [entry for entry in self._per_row if entry[2] in self._waiting]
            heapq.heapify(self._per_row)
        heapq.heappush(self._per_row, (-workspace / rows, next(self._order), token))
        self.request_bytes += request_bytes
        return token

    def take(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` more of a request's own (its body as it is received), or refuse them
        (RESOURCE_EXHAUSTED) when that would go over the limit; ``release_received`` gives them back."""
        if self.held + nbytes > self.limit:
            raise InflightBytesExceeded(self.held, nbytes, self.limit, what)
        self.request_bytes += nbytes
        self.received_bytes += nbytes

    def release_received(self, nbytes: int) -> None:
        """A request's bytes as received, not admitted (refused, or ended), go."""
        self.request_bytes -= nbytes
        self.received_bytes -= nbytes
        self._admit_waiting()  # room, though none of the memory the line waits on (a refused request's, often)

    def keep(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` of state kept between requests (a sequence's cache), or refuse them
        (RESOURCE_EXHAUSTED) when that would go over the limit; ``let_go`` gives them back."""
        if self.kept_bytes + nbytes > self.kept_limit:
            raise RequestError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"{what} would take {nbytes} bytes where the sequences live hold {self.kept_bytes}; together over "
                f"their share of the budget, --sequence-bytes-share {self.kept_share:g} of --max-inflight-bytes "
                f"{self.limit} ({self.kept_limit} bytes; the rest is kept for stateless requests); end a sequence or "
                "retry later",
            )
        if self.held + nbytes > self.limit:
            raise InflightBytesExceeded(self.held, nbytes, self.limit, what)
        self.kept_bytes += nbytes

    def let_go(self, nbytes: int) -> None:
        self.kept_bytes -= nbytes
        self._given_back()

    def run_made(self, workspace: int) -> None:
        """A run of this workspace was made: the arena keeps its space for the next runs."""
        self._largest_runs = heapq.nlargest(self.workers, [*self._largest_runs, workspace])

    def run_ended(self, token: object | None) -> None:
        ended = self._waiting.pop(token, None)
        if ended is not None:
            self._waiting_rows -= ended[0]
            self._waiting_workspace -= ended[1]
            self._given_back()

    def release(self, request_bytes: int) -> None:
        """An admitted request's bytes (its inputs, or its answer) go."""
        self.request_bytes -= request_bytes
        self._given_back()

    def provide_for(self, max_batch_size: int | None, padded_runs: bool) -> None:
        """A model is served that batches up to ``max_batch_size`` rows (None: it does not batch), padded or
        not: the estimate covers its runs too (a model's config.pbtxt may batch or pad where the flags did not;
        never beyond the server's --max-batch-size)."""
        if max_batch_size is not None:
            self.max_batch_size = max(self.max_batch_size or 0, max_batch_size)
        self.padded_runs = self.padded_runs or padded_runs

    def workspace_given_back(self) -> None:
        """The arenas were shrunk: the workspace kept for later runs is gone."""
        self._largest_runs = []
        self._given_back()
