"""A served version's step graph (export/step.py) and the caches it runs over: a step of a sequence is its new
rows, run over the sequence's projected keys and values so far; its answer is the rows' output and attention
weights over every key, and the cache grown by the rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from mhaserve.contract.steps import PAST_LENGTHS, own_cache, own_weights, padded_pasts

CUDA = "CUDAExecutionProvider"

# Steps of several sequences run as one padded batch while each past's keys and values (per batch row) and the
# padded batch's fit these bounds; past them, one after another was measured faster (BENCHMARKS.md, "Sequences").
PADDED_STEP_PAST_BYTES = 512 << 10
PADDED_STEPS_BYTES = 16 << 20


@dataclass(frozen=True)
class StepCache:
    """A sequence's projected keys and values, [B, h, length, d_k] float32 each, where the step graph runs: host
    arrays on the CPU; on CUDA, OrtValues in the GPU's memory, so a step sends only its new rows to the device and
    brings back only its answer."""

    key: np.ndarray | ort.OrtValue
    value: np.ndarray | ort.OrtValue
    length: int
    nbytes: int
    device: str  # "cpu" or "cuda"

    @classmethod
    def of(cls, key, value) -> StepCache:
        on_host = isinstance(key, np.ndarray)
        shape = key.shape if on_host else key.shape()
        nbytes = 2 * int(np.prod(shape)) * np.dtype(np.float32).itemsize
        return cls(key, value, shape[2], nbytes, "cpu" if on_host else key.device_name())


class StepGraph:
    """The step graph's ONNX Runtime session, on the provider the version's full graph got. Thread-safe, as
    ONNX Runtime sessions are."""

    def __init__(self, session: ort.InferenceSession, d_model: int, num_heads: int):
        self._session = session
        self.d_model, self.num_heads = d_model, num_heads
        # Folders exported before steps of several sequences shared a run have no past_lengths input.
        self._step_takes_lengths = PAST_LENGTHS in {i.name for i in session.get_inputs()}
        # Where a sequence's cache lives: the GPU's memory when the step graph runs on CUDA.
        self._cache_device = "cuda" if session.get_providers()[0] == CUDA else "cpu"

    def empty_cache(self, batch: int) -> StepCache:
        """The cache of a sequence before its first step: no rows."""
        d_k = self.d_model // self.num_heads
        empty = np.zeros((batch, self.num_heads, 0, d_k), np.float32)
        if self._cache_device == "cpu":
            return StepCache.of(empty, empty.copy())
        return StepCache.of(*(ort.OrtValue.ortvalue_from_numpy(empty, "cuda", 0) for _ in range(2)))

    @property
    def batches_steps(self) -> bool:
        """Steps of several sequences can share a run: on the CPU, with a step graph that takes past_lengths. On
        CUDA each step keeps its cache on the device and runs alone."""
        return self._cache_device == "cpu" and self._step_takes_lengths

    def run_steps(
        self, steps: list[tuple[np.ndarray, StepCache]]
    ) -> tuple[list[tuple[np.ndarray, np.ndarray, StepCache]], int]:
        """Steps of several sequences, each of the same number of new rows, in one call: as one run, their pasts
        padded on the left (contract/steps.py) and each answer and grown cache cut back to its own rows, while the
        padded pasts are small and of comparable lengths; else one run after another, since copying long pasts
        into one batch costs more than the runs it saves. Returns the answers and how many runs they took."""
        pasts = [cache.length for _, cache in steps]
        rows = sum(query.shape[0] for query, _ in steps)
        longest_bytes = 2 * max(pasts) * self.d_model * np.dtype(np.float32).itemsize  # keys and values
        short = longest_bytes <= PADDED_STEP_PAST_BYTES and rows * longest_bytes <= PADDED_STEPS_BYTES
        if len(steps) == 1 or not short or max(pasts) > 2 * max(min(pasts), 1):
            return [self.run_step(query, cache) for query, cache in steps], len(steps)
        keys, lengths = padded_pasts([cache.key for _, cache in steps])
        values, _ = padded_pasts([cache.value for _, cache in steps])
        queries = np.concatenate([query for query, _ in steps])
        feed = {"query": queries, "past_key": keys, "past_value": values, PAST_LENGTHS: lengths}
        output, weights, key, value = self._session.run(None, feed)
        answers, first, longest = [], 0, keys.shape[2]
        for query, cache in steps:
            batch = query.shape[0]
            where = (first, batch, cache.length, longest)
            # Copies: the batch's buffers, padding and other sequences' rows, are not kept by this sequence.
            own_keys, own_values = (np.ascontiguousarray(own_cache(a, *where)) for a in (key, value))
            own_answer = np.ascontiguousarray(own_weights(weights, *where))
            answers.append((output[first : first + batch], own_answer, StepCache.of(own_keys, own_values)))
            first += batch
        return answers, 1

    def run_step(self, query: np.ndarray, cache: StepCache) -> tuple[np.ndarray, np.ndarray, StepCache]:
        """One step of a sequence (export/step.py): its rows' output and attention weights, and the cache grown by
        its rows. On CUDA the cache stays in the GPU's memory (I/O binding): only the rows and the answer cross.
        On the CPU, where nothing crosses, the plain run is the cheaper call."""
        lengths = {PAST_LENGTHS: np.full(query.shape[0], cache.length, np.int64)} if self._step_takes_lengths else {}
        if self._cache_device == "cpu":
            feed = {"query": query, "past_key": cache.key, "past_value": cache.value, **lengths}
            output, weights, key, value = self._session.run(None, feed)
            return output, weights, StepCache.of(key, value)
        binding = self._session.io_binding()
        binding.bind_cpu_input("query", query)
        binding.bind_ortvalue_input("past_key", cache.key)
        binding.bind_ortvalue_input("past_value", cache.value)
        for name, array in lengths.items():
            binding.bind_cpu_input(name, array)
        binding.bind_output("output")
        binding.bind_output("attn_weights")
        binding.bind_output("present_key", "cuda", 0)
        binding.bind_output("present_value", "cuda", 0)
        self._session.run_with_iobinding(binding)
        output, weights, key, value = binding.get_outputs()
        return output.numpy(), weights.numpy(), StepCache.of(key, value)
