"""Sequences: attention over a growing sequence, one step at a time, with its projected keys and values kept here.

A request joins a sequence with Triton's sequence parameters (``sequence_id``, a uint64 or a string;
``sequence_start``; ``sequence_end``), as tritonclient's ``infer(..., sequence_id=, sequence_start=,
sequence_end=)`` sends them. A step carries only its new rows (``query``; self-attention: they are the new keys and
values too); the server runs the model folder's step graph (export/step.py) over the sequence's cache and answers
the new rows' output and their attention weights over every key so far, ``[B, h, new, past + new]``.

- ``sequence_start`` begins a sequence (an id in use is restarted, as in Triton); a step without it must name a
  live sequence; ``sequence_end`` answers the step, then drops the sequence and returns its memory.
- A sequence belongs to the caller that started it (security.Callers: a named token, a client certificate): its
  id names it for that caller alone, so another caller naming the same id meets no sequence, as if it did not
  exist, and cannot read or change it; each such caller holds at most ``--max-sequences-per-client`` sequences and
  ``--max-sequence-bytes-per-client`` of caches. Where callers are not told apart (no auth, one shared token),
  ids are global, as in Triton.
- A refused step changes no sequence: a start becomes live (and restarts the id's old sequence) only once its
  step is answered, and a step that is refused leaves its sequence's cache as it was.
- Steps of one sequence run in their order: a second step while one runs waits for it.
- The cache counts in the memory budget from the step that grows it; ``--max-sequences`` live at once,
  ``--max-sequence-length`` rows each, and a sequence idle for ``--sequence-idle-timeout-s`` is dropped.
- A sequence keeps the version it started on until it ends or times out, through unloads and swaps.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mhaserve.contract.signature import OUTPUT

from .batcher import answer_of
from .errors import ErrorKind, RequestError, invalid
from .inference import InferenceRequest, InferenceResponse
from .memory import MemoryBudget
from .parameters import StepOf
from .session import StepCache
from .shaping import weights_shaping
from .tensors import AttentionRequest

REMEMBERED_ENDS = 4096  # ids recently ended or timed out, to say so when a late step names one


@dataclass
class Sequence:
    caller: str  # who started it (security.Callers); "" where callers are not told apart
    id: int | str
    served: object  # the ServedModel it started on (its session not unloaded while the sequence lives)
    batch: int
    cache: StepCache  # its projected keys and values, where the step graph runs
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    started: bool = True  # False until its first step is answered (Sequences.begin, commit)
    ended: bool = False

    @property
    def key(self) -> tuple[str, int | str]:
        return self.caller, self.id

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes


class Sequences:
    """The live sequences of the process; event loop only."""

    def __init__(
        self,
        budget: MemoryBudget,
        max_sequences: int,
        per_client: int | None = None,
        bytes_per_client: int | None = None,
    ):
        self.budget = budget
        self.max_sequences = max_sequences
        self.per_client = max_sequences if per_client is None else per_client
        self.bytes_per_client = bytes_per_client  # None: no share of its own
        self.live: dict[tuple[str, int | str], Sequence] = {}  # (caller, id) -> its sequence
        self._gone: OrderedDict[tuple[str, int | str], str] = OrderedDict()  # (caller, id) -> why no longer live
        # caller -> its starts whose first step is under way: they count against the limits as live ones do
        self._starting_by: dict[str, int] = {}
        self.steps_total = 0
        self.timed_out_total = 0

    @property
    def cache_bytes(self) -> int:
        return sum(sequence.nbytes for sequence in self.live.values())

    def begin(self, step: StepOf, served, batch: int, caller: str = "") -> Sequence:
        """The sequence this step belongs to: at ``sequence_start`` a new one, not yet live (``commit`` makes it
        live once its first step is answered), else ``caller``'s live one of that id."""
        self.drop_idle()
        key = (caller, step.id)
        if step.start:
            starting = len(self.live) + sum(self._starting_by.values())
            if key not in self.live and starting >= self.max_sequences:
                raise RequestError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"sequence {step.id!r}: {starting} sequences are live or starting, the limit --max-sequences="
                    f"{self.max_sequences}; end one (sequence_end) or retry later",
                )
            own = self._held_by(caller)
            if caller and key not in self.live and own >= self.per_client:
                raise RequestError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"sequence {step.id!r}: this client has {own} sequences live or starting, its share "
                    f"--max-sequences-per-client={self.per_client}; end one (sequence_end) or retry later",
                )
            return Sequence(caller, step.id, served, batch, served.session.empty_cache(batch), started=False)
        sequence = self.live.get(key)
        if sequence is None:
            why = self._gone.get(key, "never started (its first step needs sequence_start)")
            raise invalid(f"sequence {step.id!r} is not live: {why}")
        if sequence.batch != batch:
            raise invalid(f"sequence {step.id!r} has batch {sequence.batch}; this step's query has batch {batch}")
        return sequence

    async def step(self, call, request: InferenceRequest, attention: AttentionRequest) -> InferenceResponse:
        """One step of a sequence, for ``call`` (the InferenceCall, which admits it into the budget and times it):
        run over the sequence's cache, in its order, and grow the cache."""
        step = attention.sequence
        sequence = self.begin(step, call.served, attention.batch_size, call.caller)
        if sequence.started:
            return await self._step(call, request, attention, sequence)
        self._starting_by[sequence.caller] = self._starting_by.get(sequence.caller, 0) + 1
        try:
            return await self._step(call, request, attention, sequence)
        finally:
            self._starting_by[sequence.caller] -= 1
            if not self._starting_by[sequence.caller]:
                del self._starting_by[sequence.caller]

    def continued_by(self, step: StepOf | None, model: str, caller: str) -> Sequence | None:
        """The live sequence of ``model`` that ``step`` continues (a step without ``sequence_start``), if any."""
        if step is None or step.start:
            return None
        sequence = self.live.get((caller, step.id))
        return sequence if sequence is not None and sequence.served.signature.name == model else None

    def _held_by(self, caller: str) -> int:
        """The sequences ``caller`` has live or starting."""
        return sum(1 for s in self.live.values() if s.caller == caller) + self._starting_by.get(caller, 0)

    async def _step(
        self, call, request: InferenceRequest, attention: AttentionRequest, sequence: Sequence
    ) -> InferenceResponse:
        step = attention.sequence
        # The version the sequence started on answers every step of it: its cache holds that version's keys and
        # values, whatever version has been loaded since.
        served = sequence.served
        signature = served.signature
        if request.version and request.version != signature.version:
            raise invalid(
                f"sequence {step.id!r} runs on version {signature.version} (where it started); this step names "
                f"version {request.version}"
            )
        async with sequence.lock:  # a second step of the same sequence waits for this one
            if sequence.ended:
                raise invalid(f"sequence {step.id!r} is not live: it ended while this step waited")
            rows = attention.query.shape[1]
            self.check_growth(sequence, rows)
            total = sequence.length + rows
            named = tuple(o.name for o in request.outputs)
            shaping, outputs = weights_shaping(request.parameters, named, signature.num_heads, rows, total)
            attention.shaping, attention.key = shaping, np.empty((attention.batch_size, total, 0), np.float32)
            if outputs is not None:
                attention.outputs = outputs
            call.admit(attention, signature)
            started = time.perf_counter_ns()
            output, weights, cache = await served.steps.run(attention.query, sequence.cache)
            call.timing.infer_ns = time.perf_counter_ns() - started
            call.run_ended(attention.batch_size, started)
            asked = attention.outputs
            answer, error = answer_of(
                asked, shaping, output if OUTPUT in asked else None, weights, served.batcher.computed_in
            )
            if error is not None:  # the cache is not grown by a step that overflowed
                raise error
            if not sequence.ended:  # restarted while this step ran: its answer stands, the old cache does not
                self.grow(sequence, cache)
            if not sequence.started:
                self._commit(sequence)
        if step.end:
            self.end(sequence)
        return InferenceResponse(signature, request, answer, frozenset())

    def check_growth(self, sequence: Sequence, rows: int) -> None:
        limit, named = self._of_model(sequence, "max_sequence_length")
        if sequence.length + rows > limit:
            raise RequestError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"sequence {sequence.id!r}: {sequence.length} rows + {rows} would pass {named}={limit}; end it and "
                "start another",
            )

    @staticmethod
    def _of_model(sequence: Sequence, name: str):
        """A sequence setting of the model it runs on (its config.pbtxt, else the server's flag), and its name."""
        settings = sequence.served.settings
        return getattr(settings, name), settings.named(name)

    def grow(self, sequence: Sequence, cache: StepCache) -> None:
        """The step's cache replaces the sequence's: its new bytes are taken in the budget (RESOURCE_EXHAUSTED
        when they do not fit: the sequence stays as it was)."""
        growth = cache.nbytes - sequence.nbytes
        if sequence.caller and self.bytes_per_client is not None:
            own = sum(s.nbytes for s in self.live.values() if s.caller == sequence.caller and s is not sequence)
            if own + cache.nbytes > self.bytes_per_client:
                raise RequestError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"sequence {sequence.id!r}: this client's sequences would hold {own + cache.nbytes} bytes of keys "
                    f"and values, past its share --max-sequence-bytes-per-client={self.bytes_per_client}; end one",
                )
        self.budget.keep(growth, f"sequence {sequence.id!r}'s keys and values")
        sequence.cache = cache
        sequence.last_used = time.monotonic()
        self.steps_total += 1

    def _commit(self, sequence: Sequence) -> None:
        """A started sequence's first step was answered: it is live, in place of any of its id (restarted)."""
        if sequence.key in self.live:
            self._drop(self.live[sequence.key], "restarted")
        sequence.served.sequence_started()
        sequence.started = True
        self.live[sequence.key] = sequence
        self._gone.pop(sequence.key, None)

    def end(self, sequence: Sequence, why: str = "ended (sequence_end)") -> None:
        if self.live.get(sequence.key) is sequence:
            self._drop(sequence, why)

    def drop_idle(self) -> None:
        """Drop the sequences idle past the timeout, returning their memory."""
        now = time.monotonic()
        for sequence in list(self.live.values()):
            timeout, named = self._of_model(sequence, "sequence_idle_timeout_s")
            if now - sequence.last_used > timeout and not sequence.lock.locked():
                self.timed_out_total += 1
                self._drop(sequence, f"dropped after {timeout:g} s idle ({named})")

    def drop_all(self, why: str) -> None:
        for sequence in list(self.live.values()):
            self._drop(sequence, why)

    def _drop(self, sequence: Sequence, why: str) -> None:
        del self.live[sequence.key]
        sequence.ended = True
        self.budget.let_go(sequence.nbytes)
        sequence.served.sequence_ended()
        self._gone[sequence.key] = why
        while len(self._gone) > REMEMBERED_ENDS:
            self._gone.popitem(last=False)


class StepRuns:
    """One served version's sequence steps, on its step graph: the steps of different sequences that gathered while
    a call was in progress go together in the next one (as dynamic batching does for stateless requests at no queue
    delay), if they carry the same number of new rows, up to ``max_rows`` batch rows; the session runs them as one
    padded batch where that pays, else one after another in that call (AttentionSession.run_steps). Event loop
    only."""

    def __init__(self, session, executor, max_rows: int, on_runs: Callable[[int], None] = lambda runs: None):
        self._session, self._executor, self._max_rows, self._on_runs = session, executor, max_rows, on_runs
        self._waiting: list[tuple[np.ndarray, StepCache, asyncio.Future]] = []
        self._runner: asyncio.Task | None = None

    async def run(self, query: np.ndarray, cache: StepCache) -> tuple[np.ndarray, np.ndarray, StepCache]:
        """The step's output, attention weights and grown cache."""
        answer = asyncio.get_running_loop().create_future()
        self._waiting.append((query, cache, answer))
        if self._runner is None:
            self._runner = asyncio.create_task(self._run_waiting())
        return await answer

    def _next_group(self) -> list[tuple[np.ndarray, StepCache, asyncio.Future]]:
        """The first waiting step, and those that may share its call."""
        first = self._waiting[0]
        group, rows, new_rows = [first], first[0].shape[0], first[0].shape[1]
        if not self._session.batches_steps:
            return group
        for waiting in self._waiting[1:]:
            query = waiting[0]
            if query.shape[1] == new_rows and rows + query.shape[0] <= self._max_rows:
                group.append(waiting)
                rows += query.shape[0]
        return group

    async def _run_waiting(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._waiting:
                group = self._next_group()
                taken = {id(waiting) for waiting in group}
                self._waiting = [waiting for waiting in self._waiting if id(waiting) not in taken]
                steps = [(query, cache) for query, cache, _ in group]
                try:
                    answers, runs = await loop.run_in_executor(self._executor, self._session.run_steps, steps)
                except Exception as error:  # each step of the run gets its error
                    for *_, answer in group:
                        if not answer.done():
                            answer.set_exception(error)
                    continue
                self._on_runs(runs)
                for (*_, answer), result in zip(group, answers, strict=True):
                    if not answer.done():  # a step whose caller gave up: its sequence is not grown
                        answer.set_result(result)
        finally:
            self._runner = None
