"""How a served version runs a request: one small interface, a runtime per kind of run.

The inference call (dataplane.InferenceCall) resolves the version, checks the request against it and hands it to
the version's runtime for its kind (``ServedModel.runtime_for``): stateless requests to its ``BatchedRuntime``
(dynamic batching over the full graph), steps of sequences to its ``sequences.SequenceRuntime`` (the step graph
over a sequence's cache). Each runtime admits the request through the call when it knows what the run will hold
(``Admission.admit``: memory), says when it ran (``Admission.ran``: timing), and answers the outputs asked for,
shaped and checked for overflow in one place (answers.answer_from_run). Room for more kinds: a runtime is anything with
``answer``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .batcher import Batcher
from .inference import InferenceRequest
from .tensors import RunInputs


class Admission(Protocol):
    """What a runtime asks of the call it runs a request for."""

    served: object  # the ServedModel the call resolved to
    caller: str  # who it comes from ("" where callers are not told apart)
    timeout_s: float | None
    trace: object

    def admit(self, attention: RunInputs) -> None:
        """Its inputs, its answer and its run's workspace taken in the memory budget, or RESOURCE_EXHAUSTED."""

    def ran(self, rows: int, started_ns: int, *, queue_ns: int, infer_ns: int) -> None:
        """Its run is over: the run's rows, when it started, the request's time queued and in it."""


class Runtime(Protocol):
    async def answer(self, call: Admission, request: InferenceRequest, attention: RunInputs) -> dict[str, np.ndarray]:
        """The outputs ``attention`` asked for, in its order (RequestError if it cannot be answered)."""


class BatchedRuntime:
    """Stateless requests of one served version, merged into runs by its batcher."""

    def __init__(self, batcher: Batcher):
        self.batcher = batcher

    async def answer(self, call: Admission, request: InferenceRequest, attention: RunInputs) -> dict[str, np.ndarray]:
        if call.trace is not None:
            call.trace.decoded(attention, request.id)
        call.admit(attention)
        answer = await self.batcher.submit(attention, call.timeout_s, call.trace)
        call.ran(answer.run_rows, answer.run_started_ns, queue_ns=answer.queue_ns, infer_ns=answer.infer_ns)
        return {name: answer.outputs[name] for name in attention.outputs}
