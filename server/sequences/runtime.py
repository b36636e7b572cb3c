"""A served version's sequence runtime: a step of a sequence checked against its sequence, admitted, run over its
cache on the version's step graph (with other sequences' steps where they can share a run), and answered; the
cache grown only by a step that is answered. The runtime opens and owns the folder's step graphs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from mhaserve.contract.model_dir import STEP_FILES
from mhaserve.contract.signature import OUTPUT

from ..errors import ErrorKind, RequestError, invalid
from ..graphs import AttentionGraphs
from ..inference import InferenceRequest
from ..model_config import ModelSettings
from ..outputs import asks_for_weights, outputs_from_run
from ..parameters import SequenceParameters, weights_shaping
from ..parity import LiveParity
from ..session import CPU
from ..tensors import RunInputs
from .graph import Step, StepGraph, StepRun
from .runs import StepRuns
from .state import Sequence, Sequences

if TYPE_CHECKING:
    from ..runtime import Admission, ProcessShare

log = logging.getLogger("mhaserve.server")


def open_step_graphs(graphs: AttentionGraphs) -> tuple[StepGraph | None, StepGraph | None]:
    """The folder's self-attention and cross-attention step graphs (None where it has none), on the device of its
    full ``graphs``. The grouped graphs only on the CPU: on CUDA each step runs alone, its cache on the device."""
    folder, info = graphs.folder, graphs.info
    step, cross, grouped, grouped_cross = (
        graphs.open_graph(folder.step_path(kind)) if graphs.provider == CPU or not kind.startswith("grouped") else None
        for kind in STEP_FILES
    )
    if step is None:
        return None, None
    if not StepGraph.writes_new_rows(step):
        log.warning(
            "%s: exported before sequences' caches were written in place; it serves no sequences. Export it "
            "again to serve them",
            folder.path,
        )
        return None, None
    cross_steps = None if cross is None else StepGraph(cross, info.d_model, info.num_heads, grouped_cross)
    return StepGraph(step, info.d_model, info.num_heads, grouped), cross_steps


class SequenceRuntime:
    """Runs the steps of sequences for one served version (runtime.Runtime): its step runs, and the process's
    sequences they belong to. A step continuing a sequence runs on the version that sequence started on (the data
    plane resolves it there), whatever has been loaded since. A version whose folder has no step graph has one too,
    which refuses every step, saying why."""

    def __init__(
        self,
        sequences: Sequences,
        runs: StepRuns | None,
        cross_runs: StepRuns | None = None,
        *,
        computed_in: str,
        parity: LiveParity | None = None,
    ):
        self.sequences, self.runs, self.cross_runs, self.computed_in = sequences, runs, cross_runs, computed_in
        self.parity = parity  # the version's live parity, which checks a share of its steps too

    @classmethod
    def build(
        cls,
        graphs: AttentionGraphs,
        model: ModelSettings,
        sequences: Sequences,
        share: ProcessShare,
        parity: LiveParity | None = None,
        on_runs: Callable[[list[StepRun]], None] = lambda runs: None,
    ) -> SequenceRuntime:
        """The steps of the folder of ``graphs``, on its step graphs, where it has them; ``parity`` checks a share
        of them, and ``on_runs`` is told of the runs each group of steps took (the version's statistics)."""
        runs = [
            None if graph is None else StepRuns(graph, share.executor, model.max_batch_size, on_runs)
            for graph in open_step_graphs(graphs)
        ]
        return cls(sequences, *runs, computed_in=graphs.info.computed_in, parity=parity)

    @property
    def serves_sequences(self) -> bool:
        return self.runs is not None

    def takes(self, request: InferenceRequest) -> bool:
        return request.sequence_step is not None

    def describe(self) -> dict[str, object]:
        return {"sequences": self.serves_sequences, "cross_attention_sequences": self.cross_runs is not None}

    def release_memory(self) -> None:
        pass  # a step's buffers are its sequence's, given back when it ends

    def close(self) -> None:
        self.runs = self.cross_runs = None

    async def infer(self, call: Admission, request: InferenceRequest, attention: RunInputs) -> dict[str, np.ndarray]:
        step = request.sequence_step
        self._check(call, request)
        keys_given = attention.key is not attention.query
        if step.start and keys_given and self.cross_runs is None:
            raise RequestError(
                ErrorKind.UNIMPLEMENTED,
                f"sequence {step.id!r}: model '{call.served.signature.name}' version {call.served.signature.version} "
                "serves no cross-attention sequences (its folder has no cross-attention step graph: export it again "
                "with this mhaserve)",
            )
        sequences, empty_cache = self.sequences, self.runs.graph.empty_cache
        sequence = sequences.begin(step, call.served, empty_cache, attention.batch_size, call.caller, keys_given)
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

    def _check(self, call: Admission, request: InferenceRequest) -> None:
        """A step this version can take: it serves sequences, and the step has no mask and no outputs to place in
        shared memory (answered as a stateless request, a step would be wrong with OK)."""
        if not self.serves_sequences:
            signature = call.served.signature
            raise RequestError(
                ErrorKind.UNIMPLEMENTED,
                f"parameter 'sequence_id': model '{signature.name}' version {signature.version} serves no sequences "
                "(its folder has no step graph, or an older one: sequences are served from float32 exports of this "
                "mhaserve, so export it again); or send the whole sequence so far in one request, with a causal mask",
            )
        if "mask" in request.inputs:
            raise invalid(
                "input 'mask': a step of a sequence takes no mask (a self-attention step's rows attend every earlier "
                "row and causally among themselves; a cross-attention step's, every key its sequence was given)"
            )
        if request.output_placements():
            raise invalid("a step of a sequence answers over the socket: its outputs cannot go to shared memory")

    async def _step(
        self, call: Admission, request: InferenceRequest, attention: RunInputs, sequence: Sequence
    ) -> dict[str, np.ndarray]:
        _check_position(request.sequence_step, sequence)
        rows = attention.query.shape[1]
        # Its new keys: a self-attention step's rows; a cross-attention step's keys, if it brings any.
        given = None if attention.key is attention.query else (attention.key, attention.value)
        new_keys = given[0].shape[1] if given else 0 if sequence.cross else rows
        self.sequences.check_growth(sequence, new_keys)
        total = sequence.length + new_keys
        named = tuple(o.name for o in request.outputs)
        num_heads = sequence.served.signature.num_heads
        shaping, outputs = weights_shaping(request.parameters, named, num_heads, rows, total)
        # its keys: the sequence's cache and its new ones
        attention = replace(attention, shaping=shaping, attended=total, outputs=outputs or attention.outputs)
        await call.admit(attention)
        started = time.perf_counter_ns()
        runs = self.cross_runs if sequence.cross else self.runs
        asked = attention.outputs
        step = Step(attention.query, sequence.cache, *(given or (None, None)), weights=asks_for_weights(asked))
        shaping, computed_in = attention.shaping, self.computed_in

        def answering(output, weights):  # on the inference thread
            return outputs_from_run(asked, shaping, output if OUTPUT in asked else None, weights, computed_in)

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
        if self.parity is not None:
            self.parity.offer_step(request.id, str(request.sequence_step.id), attention, step.cache.held,
                                   sequence.cross, answer)  # fmt: skip
        if not sequence.ended:  # restarted while this step ran: its answer stands, the old cache does not
            self.sequences.grow(sequence, cache)
        if not sequence.started:
            self.sequences.commit(sequence)
        return answer


def _check_position(step: SequenceParameters, sequence: Sequence) -> None:
    """A step that says where it goes (``sequence_position``: the rows the sequence holds before it) goes there: one
    already applied (resent after its answer was lost) or one past a gap is refused, the sequence left as it was."""
    if step.position is None or step.start or step.position == sequence.length:
        return
    if step.position < sequence.length:
        raise RequestError(
            ErrorKind.ALREADY_EXISTS,
            f"sequence {step.id!r} holds {sequence.length} rows; this step is for position {step.position}: a step "
            "there was applied already (a resend of one whose answer was lost?), and is not applied twice",
        )
    missing = step.position - sequence.length
    span = f"row {sequence.length}" if missing == 1 else f"rows {sequence.length}..{step.position - 1}"
    raise RequestError(
        ErrorKind.FAILED_PRECONDITION,
        f"sequence {step.id!r} holds {sequence.length} rows; this step is for position {step.position}: the steps "
        f"for {span} never arrived; send them first",
    )
