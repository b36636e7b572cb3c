"""The live sequences of the process: who started each (its owner), its cache and version, the limits on how many
and how large, and their ends (sequence_end, a restart, the idle timeout, the server's stop)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..errors import ErrorKind, RequestError, invalid
from ..memory import MemoryBudget
from ..parameters import SequenceParameters
from .graph import StepCache

if TYPE_CHECKING:
    from ..inference import InferenceRequest
    from ..runtime import ServedVersion

REMEMBERED_ENDS = 4096  # ids recently ended or timed out, to say so when a late step names one


class SequenceHomes(Protocol):
    """Where the anonymous sequences of a server of several workers live (worker_forward.SequenceHomes)."""

    def claim(self, sequence_id: int | str) -> None:
        """The sequence lives in this worker from now on."""

    def release(self, sequence_id: int | str) -> None:
        """This worker no longer knows the sequence."""

    def taken_elsewhere(self, sequence_id: int | str) -> bool:
        """Whether a start in another worker has taken the sequence since this one claimed it."""


@dataclass
class Sequence:
    caller: str  # who started it (security.Callers); "" where callers are not told apart
    id: int | str
    served: ServedVersion  # the version it started on (pinned: not unloaded while the sequence lives)
    batch: int
    cache: StepCache  # its projected keys and values, where the step graph runs
    last_used: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    started: bool = True  # False until its first step is answered (Sequences.begin, commit)
    ended: bool = False
    cross: bool = False  # a cross-attention sequence: its keys and values given in rows of their own

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
        homes: SequenceHomes | None = None,
    ):
        """``homes``: where this is one of several workers, where they find its anonymous sequences (an identified
        caller's live in the worker its name hashes to)."""
        self.budget = budget
        self.homes = homes
        self.max_sequences = max_sequences
        self.per_client = max_sequences if per_client is None else per_client
        self.bytes_per_client = bytes_per_client  # None: no share of its own
        self.live: dict[tuple[str, int | str], Sequence] = {}  # (caller, id) -> its sequence
        self._gone: OrderedDict[tuple[str, int | str], str] = OrderedDict()  # (caller, id) -> why no longer live
        # caller -> its starts whose first step is under way: they count against the limits as live ones do
        self._starting_by: dict[str, int] = {}
        # caller -> the bytes of its live sequences' keys and values, kept up as they grow and end, so that a step's
        # check against --max-sequence-bytes-per-client costs the same however many sequences are live
        self._bytes_by: dict[str, int] = {}
        self.steps_total = 0
        self.timed_out_total = 0
        self._unknown = "never started (its first step needs sequence_start)"  # why an id no one knows is not live

    def lost_before(self, when: str) -> None:
        """This process replaced one that held sequences (``when``: how it was lost), so a step of a sequence it
        does not know may be of one lost with it: its refusal says so."""
        self._unknown = (
            f"never started here, or lost {when}, with every sequence it held; start it again from its first row "
            "with sequence_start"
        )

    @property
    def cache_bytes(self) -> int:
        return sum(sequence.nbytes for sequence in self.live.values())

    def begin(
        self,
        step: SequenceParameters,
        served: ServedVersion,
        empty_cache: Callable[[int], StepCache],
        batch: int,
        caller: str = "",
        cross: bool = False,
    ) -> Sequence:
        """The sequence this step belongs to: at ``sequence_start`` a new one (a cross-attention one where ``cross``),
        not yet live (``commit`` makes it live once its first step is answered), else ``caller``'s live one of that
        id. A step names its own sequence; only a start looks at every sequence (the idle ones' room is freed first),
        so that a step costs the same however many sequences are live."""
        key = (caller, step.id)
        if step.start:
            self.drop_idle()
            starting = len(self.live) + sum(self._starting_by.values())
            if key not in self.live and starting >= self.max_sequences:
                raise RequestError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"sequence {step.id!r}: {starting} sequences are live or starting, the limit --max-sequences="
                    f"{self.max_sequences}; end one (sequence_end) or retry later",
                    shed_by="sequences",
                )
            own = self._held_by(caller)
            if caller and key not in self.live and own >= self.per_client:
                raise RequestError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"sequence {step.id!r}: this client has {own} sequences live or starting, its share "
                    f"--max-sequences-per-client={self.per_client}; end one (sequence_end) or retry later",
                    shed_by="client_share",
                )
            cache = empty_cache(batch)
            return Sequence(caller, step.id, served, batch, cache, started=False, cross=cross)
        sequence = self.live.get(key)
        if sequence is not None and self._idle(sequence, time.monotonic()):
            self._time_out(sequence)
            sequence = None
        if sequence is None:
            why = self._gone.get(key, self._unknown)
            raise invalid(f"sequence {step.id!r} is not live: {why}")
        if sequence.batch != batch:
            raise invalid(f"sequence {step.id!r} has batch {sequence.batch}; this step's query has batch {batch}")
        return sequence

    @contextlib.contextmanager
    def starting(self, sequence: Sequence):
        """While a start's first step is under way: it counts against the limits as a live sequence does."""
        if sequence.started:
            yield
            return
        self._starting_by[sequence.caller] = self._starting_by.get(sequence.caller, 0) + 1
        try:
            yield
        finally:
            self._starting_by[sequence.caller] -= 1
            if not self._starting_by[sequence.caller]:
                del self._starting_by[sequence.caller]

    def served_for(self, request: InferenceRequest, caller: str) -> ServedVersion | None:
        """The version a step continuing one of ``caller``'s live sequences of the model it names runs on (the one
        the sequence started on, whether or not it still takes new requests: an unloaded or replaced version serves
        its sequences to their end); None for any other request."""
        try:
            step = request.sequence_step
        except RequestError:  # refused by the request's own check, once it has a version
            return None
        if step is None or step.start:
            return None
        sequence = self.live.get((caller, step.id))
        return sequence.served if sequence is not None and sequence.served.signature.name == request.model else None

    async def drop_idle_until(self, stopped: Callable[[], bool], timeout_s: float) -> None:
        """Until ``stopped()``: the sequences idle past their timeout are dropped, their memory returned, whether or
        not other steps come (looked at each second: a model's config.pbtxt may give its sequences less than the
        server's ``timeout_s``), and so are those another worker's start has taken."""
        while not stopped():
            await asyncio.sleep(min(timeout_s, 1.0))
            self.drop_idle()
            self.drop_taken_elsewhere()

    def _held_by(self, caller: str) -> int:
        """The sequences ``caller`` has live or starting."""
        return sum(1 for s in self.live.values() if s.caller == caller) + self._starting_by.get(caller, 0)

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
        is_live = self.live.get(sequence.key) is sequence
        if sequence.caller and self.bytes_per_client is not None:
            own = self._bytes_by.get(sequence.caller, 0) - (sequence.nbytes if is_live else 0)  # its others'
            if own + cache.nbytes > self.bytes_per_client:
                raise RequestError(
                    ErrorKind.RESOURCE_EXHAUSTED,
                    f"sequence {sequence.id!r}: this client's sequences would hold {own + cache.nbytes} bytes of keys "
                    f"and values, past its share --max-sequence-bytes-per-client={self.bytes_per_client}; end one",
                    shed_by="client_share",
                )
        self.budget.keep(growth, f"sequence {sequence.id!r}'s keys and values")
        if is_live:
            self._count_bytes(sequence.caller, growth)
        sequence.cache = cache
        sequence.last_used = time.monotonic()
        self.steps_total += 1

    def commit(self, sequence: Sequence) -> None:
        """A started sequence's first step was answered: it is live, in place of any of its id (restarted)."""
        if sequence.key in self.live:
            self._drop(self.live[sequence.key], "restarted")
        sequence.served.pin()
        sequence.started = True
        self.live[sequence.key] = sequence
        self._count_bytes(sequence.caller, sequence.nbytes)
        self._gone.pop(sequence.key, None)
        if self.homes is not None and not sequence.caller:
            self.homes.claim(sequence.id)

    def end(self, sequence: Sequence, why: str = "ended (sequence_end)") -> None:
        if self.live.get(sequence.key) is sequence:
            self._drop(sequence, why)

    def _count_bytes(self, caller: str, nbytes: int) -> None:
        held = self._bytes_by.get(caller, 0) + nbytes
        if held:
            self._bytes_by[caller] = held
        else:
            self._bytes_by.pop(caller, None)

    def drop_idle(self) -> None:
        """Drop the sequences idle past the timeout, returning their memory (the data plane calls this every
        second, or sooner where the timeout is shorter)."""
        now = time.monotonic()
        for sequence in [s for s in self.live.values() if self._idle(s, now)]:
            self._time_out(sequence)

    def drop_taken_elsewhere(self) -> None:
        """Drop the anonymous sequences that a start of the same id in another worker has taken since (two starts
        at once on two workers: the later claim wins, every step goes there, and the copy here would hold its
        memory until the idle timeout). Looked at each second, not at each start: one readlink per sequence."""
        if self.homes is None:
            return
        for sequence in list(self.live.values()):
            if not sequence.caller and not sequence.lock.locked() and self.homes.taken_elsewhere(sequence.id):
                self._drop(sequence, "started again in another worker of this server by a later sequence_start")

    def _idle(self, sequence: Sequence, now: float) -> bool:
        """Idle past its model's timeout, and no step of it under way."""
        idle_for = now - sequence.last_used
        return idle_for > self._of_model(sequence, "sequence_idle_timeout_s")[0] and not sequence.lock.locked()

    def _time_out(self, sequence: Sequence) -> None:
        timeout, named = self._of_model(sequence, "sequence_idle_timeout_s")
        self.timed_out_total += 1
        self._drop(sequence, f"dropped after {timeout:g} s idle ({named})")

    def drop_all(self, why: str) -> None:
        for sequence in list(self.live.values()):
            self._drop(sequence, why)

    def _drop(self, sequence: Sequence, why: str) -> None:
        del self.live[sequence.key]
        sequence.ended = True
        self.budget.let_go(sequence.nbytes)
        self._count_bytes(sequence.caller, -sequence.nbytes)
        sequence.served.unpin()
        self._gone[sequence.key] = why
        while len(self._gone) > REMEMBERED_ENDS:
            (caller, sequence_id), _ = self._gone.popitem(last=False)
            if self.homes is not None and not caller:  # its end forgotten here: later steps are answered anywhere
                self.homes.release(sequence_id)
