"""A served version's sequence runtime: a step of a sequence checked against its sequence, admitted, run over its
cache on the version's step graph (with other sequences' steps where they can share a run), and answered; the
cache grown only by a step that is answered."""

from __future__ import annotations

import time

import numpy as np

from mhaserve.contract.signature import OUTPUT

from ..answers import answer_from_run, asks_for_weights
from ..errors import ErrorKind, RequestError, invalid
from ..parameters import weights_shaping
from .graph import Step
from .runs import StepRuns
from .state import Sequence, Sequences


class SequenceRuntime:
    """Runs the steps of sequences for one served version (runtime.Runtime): its step runs, and the process's
    sequences they belong to. A step continuing a sequence runs on the version that sequence started on (the data
    plane resolves it there), whatever has been loaded since."""

    def __init__(self, sequences: Sequences, runs: StepRuns, cross_runs: StepRuns | None = None, *, computed_in: str):
        self.sequences, self.runs, self.cross_runs, self.computed_in = sequences, runs, cross_runs, computed_in

    async def answer(self, call, request, attention) -> dict[str, np.ndarray]:
        sequences, step = self.sequences, attention.sequence
        keys_given = attention.key is not attention.query
        if step.start and keys_given and self.cross_runs is None:
            raise RequestError(
                ErrorKind.UNIMPLEMENTED,
                f"sequence {step.id!r}: model '{call.served.signature.name}' version {call.served.signature.version} "
                "serves no cross-attention sequences (its folder has no cross-attention step graph: export it again "
                "with this mhaserve)",
            )
        sequence = sequences.begin(step, call.served, attention.batch_size, call.caller, cross=keys_given)
        if keys_given and not sequence.cross:
            raise invalid(
                f"input 'key': sequence {step.id!r} is a self-attention sequence (it started without keys): its steps "
                "carry their new rows as 'query' alone"
            )
        signature = sequence.served.signature
        if request.version and request.version != signature.version:
            raise invalid(
                f"sequence {step.id!r} runs on version {signature.version} (where it started); this step names "
                f"version {request.version}"
            )
        with sequences.starting(sequence):
            async with sequence.lock:  # a second step of the same sequence waits for this one
                if sequence.ended:
                    raise invalid(f"sequence {step.id!r} is not live: it ended while this step waited")
                answer = await self._step(call, request, attention, sequence)
        if step.end:
            sequences.end(sequence)
        return answer

    async def _step(self, call, request, attention, sequence: Sequence) -> dict[str, np.ndarray]:
        rows = attention.query.shape[1]
        # Its new keys: a self-attention step's rows; a cross-attention step's keys, if it brings any.
        given = None if attention.key is attention.query else (attention.key, attention.value)
        new_keys = given[0].shape[1] if given else 0 if sequence.cross else rows
        self.sequences.check_growth(sequence, new_keys)
        total = sequence.length + new_keys
        named = tuple(o.name for o in request.outputs)
        num_heads = sequence.served.signature.num_heads
        attention.shaping, outputs = weights_shaping(request.parameters, named, num_heads, rows, total)
        attention.attended = total  # its keys: the sequence's cache and its new ones
        if outputs is not None:
            attention.outputs = outputs
        call.admit(attention)
        started = time.perf_counter_ns()
        runs = self.cross_runs if sequence.cross else self.runs
        asked = attention.outputs
        step = Step(attention.query, sequence.cache, *(given or (None, None)), weights=asks_for_weights(asked))
        shaping, computed_in = attention.shaping, self.computed_in

        def answering(output, weights):  # on the inference thread
            return answer_from_run(asked, shaping, output if OUTPUT in asked else None, weights, computed_in)

        (answer, error), cache = await runs.run(step, answering)
        infer_ns = time.perf_counter_ns() - started
        call.ran(attention.batch_size, started, queue_ns=0, infer_ns=infer_ns)
        if error is None and cache is None:  # its keys or values overflowed, though the outputs asked did not
            error = RequestError(
                ErrorKind.INVALID_ARGUMENT,
                f"the computation overflowed {self.computed_in}: the step's keys or values are not finite; inputs of "
                f"this magnitude cannot be attended over in {self.computed_in}",
            )
        if error is not None:  # the cache is not grown by a step that overflowed
            raise error
        if not sequence.ended:  # restarted while this step ran: its answer stands, the old cache does not
            self.sequences.grow(sequence, cache)
        if not sequence.started:
            self.sequences.commit(sequence)
        return answer
