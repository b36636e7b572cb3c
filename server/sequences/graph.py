"""A served version's step graph (export/step.py) and the caches it runs over: a step of a sequence is its new
rows, run over the sequence's projected keys and values so far; its answer is the rows' output and attention
weights over every key, and its new rows' keys and values, written after the cache's own."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from mhaserve.contract.signature import ATTN_WEIGHTS, KEY, OUTPUT, QUERY, VALUE
from mhaserve.contract.steps import (
    NEW_KEY,
    NEW_VALUE,
    PAST_KEY,
    PAST_LENGTHS,
    PAST_VALUE,
    grouped_feed,
    grouped_members,
    member,
    own_weights,
    stacked_pasts,
    weights_from_memory,
    with_rows,
)

from .. import kernels
from ..tensors import count_non_finite

CUDA = "CUDAExecutionProvider"

# Steps of several sequences run as one batch, their rows copied side by side, while each past's keys and values (per
# batch row) fit the first bound, in runs of at most the second: past the first, one after another was measured
# faster (measured when it was chosen); more steps than one such run holds take several,
# faster than the grouped graph's runs (measured when it was chosen).
STACKED_STEP_PAST_BYTES = 512 << 10
STACKED_STEPS_BYTES = 4 << 20
# Past those bounds, steps run in the grouped step graph (each over its own buffers) where this many or more share
# a run: fewer run one after another, its empty members costing more than a shared run saves; two already gain
# where a run reads the weights from memory (contract/steps.py weights_from_memory; measured when it was
# chosen).
MIN_GROUPED_STEPS = 4


@dataclass(frozen=True)
class StepCache:
    """A sequence's projected keys and values where the step graph runs, [B, h, C, d_k] float32 each, holding its
    first ``length`` rows. On the CPU, host buffers with room to grow: a step's new rows are written in place after
    those held (contract/steps.py), and a grown cache shares the buffers of the one it grew from. On CUDA,
    OrtValues in the GPU's memory of exactly ``length`` rows, grown on the device, so a step sends only its new
    rows to it and brings back only its answer. ``nbytes``: what the buffers hold, room included."""

    key: np.ndarray | ort.OrtValue
    value: np.ndarray | ort.OrtValue
    length: int
    nbytes: int
    device: str  # "cpu" or the device the OrtValues live on

    @classmethod
    def of(cls, key, value, length: int) -> StepCache:
        on_host = isinstance(key, np.ndarray)
        shape = key.shape if on_host else key.shape()
        nbytes = 2 * math.prod(shape) * np.dtype(np.float32).itemsize
        return cls(key, value, length, nbytes, "cpu" if on_host else key.device_name())

    @property
    def on_host(self) -> bool:
        return isinstance(self.key, np.ndarray)

    def held(self) -> tuple[np.ndarray, np.ndarray]:
        """Its keys and values on the host, its ``length`` rows alone (on the CPU views: rows held are never
        written again; on CUDA copies)."""
        if self.on_host:
            return self.key[:, :, : self.length], self.value[:, :, : self.length]
        return self.key.numpy(), self.value.numpy()

    @property
    def capacity(self) -> int:
        return self.key.shape[2] if self.on_host else self.key.shape()[2]

    def grown(
        self, new_key: np.ndarray, new_value: np.ndarray, own_rows: bool, known_finite: bool = False
    ) -> StepCache | None:
        """The cache with a step's new rows after its own, on the host (``own_rows``: arrays of the step's own, not
        parts of a batch's); None where they are not finite (a step that overflowed), which no buffer may hold:
        its rows past the length are masked, and a masked infinity still makes a NaN. ``known_finite``: the caller
        checked them (a shared run's rows, checked once for all its steps)."""
        if not known_finite and (count_non_finite(new_key) or count_non_finite(new_value)):
            return None
        key = with_rows(self.key, self.length, new_key, own_rows)
        value = with_rows(self.value, self.length, new_value, own_rows)
        return StepCache.of(key, value, self.length + new_key.shape[2])


@dataclass(frozen=True)
class Step:
    """One step of a sequence: its query rows [B, n, d] and the cache it runs over; for a cross-attention sequence,
    the key and value rows [B, m, d] it adds (None: none). ``weights``: whether its answer carries attention
    weights (a step that asked for the output alone is answered no weights: None)."""

    query: np.ndarray
    cache: StepCache
    key: np.ndarray | None = None
    value: np.ndarray | None = None
    weights: bool = True

    @property
    def new_keys(self) -> int:
        return 0 if self.key is None else self.key.shape[1]


class StepGraph:
    """A step graph's ONNX Runtime session (self-attention, or cross-attention where it takes ``key`` and
    ``value``), on the provider the version's full graph got. Thread-safe, as ONNX Runtime sessions are; a
    sequence's steps run one at a time, so its buffers are written by one at once."""

    def __init__(
        self, session: ort.InferenceSession, d_model: int, num_heads: int, grouped: ort.InferenceSession | None = None
    ):
        self._session = session
        self.d_model, self.num_heads = d_model, num_heads
        self.cross = KEY in {i.name for i in session.get_inputs()}
        # Steps of several sequences over their own buffers, in one run (export/step.py grouped_step_graph, of the
        # same kind); None: a folder exported without it.
        self._grouped = grouped
        self._members = 0 if grouped is None else grouped_members(i.name for i in grouped.get_inputs())
        self._grouped_outputs = [] if grouped is None else [o.name for o in grouped.get_outputs()]
        self._min_grouped = 2 if weights_from_memory(d_model) else MIN_GROUPED_STEPS
        self._provider = session.get_providers()[0]
        # Where a sequence's cache lives: the GPU's memory when the step graph runs on CUDA.
        self._cache_device = "cuda" if self._provider == CUDA else "cpu"

    @staticmethod
    def writes_new_rows(session: ort.InferenceSession) -> bool:
        """Whether the graph returns its new rows (a cache written in place); folders exported before returned the
        whole grown cache, and serve no sequences."""
        return {NEW_KEY, NEW_VALUE} <= {output.name for output in session.get_outputs()}

    def empty_cache(self, batch: int) -> StepCache:
        """The cache of a sequence before its first step: no rows, no room."""
        d_k = self.d_model // self.num_heads
        empty = np.zeros((batch, self.num_heads, 0, d_k), np.float32)
        if self._cache_device == "cpu":
            return StepCache.of(empty, empty.copy(), 0)
        return StepCache.of(*(ort.OrtValue.ortvalue_from_numpy(empty, self._cache_device, 0) for _ in range(2)), 0)

    @property
    def batches_steps(self) -> bool:
        """Steps of several sequences can share a run on the CPU; on CUDA each step keeps its cache on the device
        and runs alone."""
        return self._cache_device == "cpu"

    def _given(self, query: np.ndarray, steps: list[Step]) -> dict[str, np.ndarray]:
        """A cross-attention graph's key and value inputs for ``steps`` in one run (they add as many keys each: no
        rows where they add none); nothing for a self-attention graph."""
        if not self.cross:
            return {}
        if steps[0].key is None:
            none = np.zeros((query.shape[0], 0, self.d_model), np.float32)
            return {KEY: none, VALUE: none}
        return {name: np.concatenate([getattr(step, name) for step in steps]) for name in (KEY, VALUE)}

    def run_steps(
        self, steps: list[Step]
    ) -> tuple[list[tuple[np.ndarray, np.ndarray, StepCache | None]], list[StepRun]]:
        """Steps of several sequences, each of the same number of new rows (and keys), in one call. While the pasts
        are small and of comparable lengths, their pasts copied side by side (contract/steps.py), each answer cut
        back to its own keys, in runs of at most STACKED_STEPS_BYTES of pasts each; else in runs of the grouped step
        graph, each step over its own buffers where they lie (one run after another, copying nothing, where too few
        steps share a call or the folder has no such graph). Either way as few runs as hold them, of sizes as even
        as can be. Returns each step's output, weights and grown cache (None where its new rows overflowed), and
        the runs they took."""
        if len(steps) == 1:
            return _runs_of([steps], self._run_alone)
        pasts = [step.cache.length for step in steps]
        longest_bytes = 2 * max(pasts) * self.d_model * np.dtype(np.float32).itemsize  # keys and values
        if longest_bytes <= STACKED_STEP_PAST_BYTES and max(pasts) <= 2 * max(min(pasts), 1):
            per_run = STACKED_STEPS_BYTES // max(longest_bytes, 1)  # first steps have no past: all in one
            return _runs_of(_even_parts(steps, per_run, size=lambda step: step.query.shape[0]), self._run_stacked)
        if len(steps) < self._min_grouped or not self._members:
            return _runs_of([[step] for step in steps], self._run_alone)
        return _runs_of(_even_parts(steps, self._members), self._run_grouped)

    def _run_alone(self, steps: list[Step]) -> list[tuple[np.ndarray, np.ndarray, StepCache | None]]:
        (step,) = steps
        return [self.run_step(step)]

    def _run_stacked(self, steps: list[Step]) -> list[tuple[np.ndarray, np.ndarray, StepCache | None]]:
        if len(steps) == 1:
            return self._run_alone(steps)
        keys, lengths = stacked_pasts([(step.cache.key, step.cache.length) for step in steps])
        values, _ = stacked_pasts([(step.cache.value, step.cache.length) for step in steps])
        queries = np.concatenate([step.query for step in steps])
        feed = {QUERY: queries, PAST_KEY: keys, PAST_VALUE: values, PAST_LENGTHS: lengths}
        output, weights, new_key, new_value = self._session.run(None, {**feed, **self._given(queries, steps)})

        def weights_of(_, first: int, batch: int, cache: StepCache) -> np.ndarray:
            # A copy: the run's weights hold other sequences' rows, which this answer does not keep
            return np.array(own_weights(weights, first, batch, cache.length, keys.shape[2]))

        return _shared_run_answers(steps, output, weights_of, new_key, new_value)

    def _run_grouped(self, steps: list[Step]) -> list[tuple[np.ndarray, np.ndarray, StepCache | None]]:
        """Steps, at most the grouped graph's members, in one run of it, each over its own buffers."""
        ran = self._grouped.run(None, grouped_feed([self._host_feed(step) for step in steps], self._members))
        outputs = dict(zip(self._grouped_outputs, ran, strict=True))

        def weights_of(i: int, _, batch: int, cache: StepCache) -> np.ndarray:
            return own_weights(outputs[member(ATTN_WEIGHTS, i)], 0, batch, cache.length, cache.capacity)

        return _shared_run_answers(steps, outputs[OUTPUT], weights_of, outputs[NEW_KEY], outputs[NEW_VALUE])

    def _host_feed(self, step: Step) -> dict[str, np.ndarray]:
        """A step's inputs to the step graph, its cache's buffers as they are, room and all."""
        lengths = np.full(step.query.shape[0], step.cache.length, np.int64)
        cache, given = step.cache, self._given(step.query, [step])
        return {QUERY: step.query, PAST_KEY: cache.key, PAST_VALUE: cache.value, PAST_LENGTHS: lengths, **given}

    def run_step(self, step: Step) -> tuple[np.ndarray, np.ndarray, StepCache | None]:
        """One step of a sequence (export/step.py): its rows' output and attention weights, and the cache grown by
        its new keys and values (None where they overflowed). On the CPU the graph reads the cache's buffers as
        they are, room and all, and the new rows are written into them. On CUDA the cache stays in the GPU's
        memory (I/O binding): only the rows and the answer cross, and the new rows are appended there."""
        query, cache = step.query, step.cache
        if cache.on_host:
            output, weights, new_key, new_value = self._session.run(None, self._host_feed(step))
            own = own_weights(weights, 0, query.shape[0], cache.length, cache.capacity) if step.weights else None
            return output, own, cache.grown(new_key, new_value, own_rows=True)
        device = cache.device
        binding = self._session.io_binding()
        lengths = np.full(query.shape[0], cache.length, np.int64)
        for name, array in {QUERY: query, PAST_LENGTHS: lengths, **self._given(query, [step])}.items():
            binding.bind_cpu_input(name, array)
        binding.bind_ortvalue_input(PAST_KEY, cache.key)
        binding.bind_ortvalue_input(PAST_VALUE, cache.value)
        binding.bind_output("output")
        # Weights not asked for stay on the device (and are never copied back).
        binding.bind_output(ATTN_WEIGHTS, *(() if step.weights else (device, 0)))
        binding.bind_output(NEW_KEY, device, 0)
        binding.bind_output(NEW_VALUE, device, 0)
        self._session.run_with_iobinding(binding)
        output, weights, new_key, new_value = binding.get_outputs()
        output = output.numpy()
        weights = weights.numpy() if step.weights else None  # brought back from the device only where asked
        if count_non_finite(output):  # its new rows may have overflowed: not appended (the answer is refused)
            return output, weights, None
        key = kernels.appended(cache.key, new_key, self._provider, device)
        value = kernels.appended(cache.value, new_value, self._provider, device)
        return output, weights, StepCache.of(key, value, cache.length + new_key.shape()[2])


@dataclass(frozen=True)
class StepRun:
    """One run of a step graph, for the version's statistics and metrics: its batch rows (every step's), and its
    time."""

    rows: int
    ns: int


def _runs_of(parts: list[list[Step]], run) -> tuple[list, list[StepRun]]:
    """Each part's steps answered by ``run(part)``, one run each, in order; the answers and the runs."""
    answers, runs = [], []
    for part in parts:
        started = time.perf_counter_ns()
        answers += run(part)
        runs.append(StepRun(sum(step.query.shape[0] for step in part), time.perf_counter_ns() - started))
    return answers, runs


def _even_parts(steps: list[Step], most: int, size=lambda step: 1) -> list[list[Step]]:
    """``steps`` in consecutive parts of at most ``most`` each (measured by ``size``; a step larger than that alone),
    as few as hold them and as even as can be: no few left over to a run of their own."""
    total = sum(size(step) for step in steps)
    share = -(-total // -(-total // most))
    parts, held = [[]], 0
    for step in steps:
        if parts[-1] and held + size(step) > share:
            parts.append([])
            held = 0
        parts[-1].append(step)
        held += size(step)
    return parts


def _shared_run_answers(steps: list[Step], output, weights_of, new_key, new_value) -> list:
    """Each step's output, weights (``weights_of(i, first row, batch, cache)``, where it asked for them) and
    grown cache from a run that several steps shared, their rows one after another in ``output``, ``new_key``
    and ``new_value``."""
    answers, first = [], 0
    finite = not (count_non_finite(new_key) or count_non_finite(new_value))  # else each step's rows are checked
    for i, step in enumerate(steps):
        batch, cache = step.query.shape[0], step.cache
        own = slice(first, first + batch)
        grown = cache.grown(new_key[own], new_value[own], own_rows=False, known_finite=finite)
        answers.append((output[own], weights_of(i, first, batch, cache) if step.weights else None, grown))
        first += batch
    return answers
