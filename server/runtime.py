"""How a served version runs a request: one small interface, a runtime per kind of run, each owning its graphs.

A served version (registry.ServedModel) is its signature, its settings and its runtimes. Each runtime is built
from the checked model folder (model_folder.ModelFolder) and opens the graphs it runs: ``BatchedRuntime`` the full
graphs (dynamic batching over them), ``sequences.SequenceRuntime`` the step graphs (a step over a sequence's
cache). The inference call (dataplane.InferenceCall) checks a request against the version and hands it to the
runtime that takes it (``ServedModel.runtime_for``). The runtime admits it through the call when it knows what the
run will hold (``Admission.admit``: memory), says when it ran (``Admission.ran``: timing), and returns the outputs
asked for, shaped and checked for overflow in one place (outputs.outputs_from_run).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from mhaserve.contract.signature import GRAPH_OUTPUT_NAMES, ModelSignature

from .batcher import NO_TERMS, Batcher, QueueTerms, QueueTimeout
from .config import LevelPolicy, ServerSettings, level_policies
from .graphs import AttentionGraphs
from .inference import InferenceRequest
from .model_config import ModelSettings
from .model_folder import ModelFolder
from .parameters import request_priority, request_timeout_us, weights_shaping
from .parity import LiveParity
from .run_cost import RUN_HERE_MAX_MULTIPLY_ADDS, FittedCosts, RunCost, fit_shapes, multiply_adds
from .session import CPU
from .statistics import BatchResult
from .tensors import Limits, RunInputs
from .threads import runs_alone, worker_board

if TYPE_CHECKING:
    from .tracing import RequestTrace

log = logging.getLogger("mhaserve.server")


class ServedVersion(Protocol):
    """What a runtime, and the sequences it keeps, need of the version they serve (registry.ServedModel)."""

    signature: ModelSignature
    settings: ModelSettings

    def pin(self) -> None:
        """State is kept on it between requests (a live sequence): it is not unloaded until ``unpin``."""

    def unpin(self) -> None: ...


class Admission(Protocol):
    """What a runtime asks of the call it runs a request for."""

    served: ServedVersion  # the version the call resolved to
    caller: str  # who it comes from ("" where callers are not told apart)
    timeout_s: float | None
    trace: RequestTrace | None

    async def admit(self, attention: RunInputs, queue_timeout: QueueTimeout | None = None) -> None:
        """Its inputs, its answer and its run's workspace taken in the memory budget once they fit, waiting up to
        its deadline (DEADLINE_EXCEEDED) and its ``queue_timeout`` (that timeout's refusal), or RESOURCE_EXHAUSTED
        where waiting cannot help."""

    def ran(self, rows: int, started_ns: int, *, queue_ns: int, infer_ns: int) -> None:
        """Its run is over: the run's rows, when it started, the request's time queued and in it."""


class Runtime(Protocol):
    """One kind of run of a served version, over graphs it opened and owns."""

    def takes(self, request: InferenceRequest) -> bool:
        """Whether requests of this kind are this runtime's."""

    async def infer(self, call: Admission, request: InferenceRequest, attention: RunInputs) -> dict[str, np.ndarray]:
        """The outputs ``attention`` asked for, in its order (RequestError if it cannot be answered)."""

    def describe(self) -> dict[str, object]:
        """How it runs (provider, threads, batching...), as the model's config and the serving line show it."""

    def release_memory(self) -> None:
        """Give back what its graphs' arenas hold beyond what a run needs (called while the server is idle)."""

    def close(self) -> None:
        """Its graphs let go: the version is unloaded."""


@dataclass(frozen=True)
class ProcessShare:
    """What the process gives every version's runtimes: its settings, its inference workers and limits, whether
    it is quiet, and the run costs fitted at earlier starts."""

    settings: ServerSettings
    executor: Executor
    limits: Limits
    quiet: Callable[[], bool]  # no other request in the server: a lone small run may be made on the event loop
    fitted_costs: FittedCosts


@dataclass(frozen=True)
class QueuePolicy:
    """A model's queue, as Triton's queue policy and priority levels say it: a request may wait ``timeout_us`` (0:
    no bound), which its own ``timeout`` parameter may shorten where ``allow_override``, never lengthen (a
    request's timeout counts only below the model's); with ``priority_levels``, a request's ``priority`` parameter
    (1 first) is its level, 0 or one past the last the default level (as Triton reads it), and a level with a
    policy of its own in ``levels`` waits as that says instead (its timeout, its override, its share of the
    queue)."""

    timeout_us: int = 0
    allow_override: bool = False
    set_by: str = ""  # where timeout_us is set, for a refusal to name
    priority_levels: int = 0
    default_priority: int = 0
    levels: dict[int, LevelPolicy] = field(default_factory=dict)
    levels_set_by: str = ""  # where the levels' policies are set

    @classmethod
    def of(cls, model: ModelSettings) -> QueuePolicy:
        return cls(model.queue_timeout_us, model.allow_timeout_override, model.named("queue_timeout_us"),
                   model.priority_levels, model.default_priority_level, level_policies(model.priority_queue_policy),
                   model.named("priority_queue_policy"))  # fmt: skip

    def terms_of(self, request: InferenceRequest) -> QueueTerms:
        # Both parameters are checked whatever the policy: a malformed one is refused.
        asked_timeout, asked_priority = request_timeout_us(request.parameters), request_priority(request.parameters)
        if not (self.timeout_us or self.priority_levels):
            return NO_TERMS
        priority = 0
        if self.priority_levels:
            priority = asked_priority if 0 < asked_priority <= self.priority_levels else self.default_priority
        own = self.levels.get(priority)
        timeout_us, allow_override, set_by = self.timeout_us, self.allow_override, self.set_by
        if own is not None:
            timeout_us, allow_override = own.default_timeout_microseconds, own.allow_timeout_override
            set_by = f"priority level {priority}'s, {self.levels_set_by}"
        timeout = None
        if allow_override and 0 < asked_timeout < timeout_us:
            timeout = QueueTimeout(asked_timeout / 1e6, "the request's 'timeout' parameter")
        elif timeout_us:
            timeout = QueueTimeout(timeout_us / 1e6, set_by)
        if own is None or not own.max_queue_size:
            return QueueTerms(timeout, priority)
        return QueueTerms(timeout, priority, own.max_queue_size, self.levels_set_by)


class BatchedRuntime:
    """Stateless requests of one served version, merged into runs of its full graphs by its batcher, each waiting
    in its queue as long as ``queue`` allows; ``parity``, where the version has live parity, checks a share of its
    answers (set once its graphs are open: it is held to the arithmetic they got)."""

    def __init__(self, graphs: AttentionGraphs, batcher: Batcher, queue: QueuePolicy):
        self.graphs, self.batcher, self.queue = graphs, batcher, queue
        self.parity: LiveParity | None = None

    @classmethod
    def build(
        cls,
        folder: ModelFolder,
        model: ModelSettings,
        share: ProcessShare,
        on_batch: Callable[[BatchResult], None],
    ) -> BatchedRuntime:
        """The folder's full graphs opened as ``model`` says, warmed up, their run cost fitted where batching is
        length-aware, and a batcher over them. Slow (seconds): called on the loader's thread."""
        alone_threads, alone = runs_alone()
        graphs = AttentionGraphs(
            folder,
            model.intra_op_threads,
            cuda_tf32=share.settings.cuda_tf32,
            intra_op_spin_ms=model.intra_op_spin_ms,
            output_only=model.output_only_graph,
            summaries=model.summaries_graph,
            alone_threads=alone_threads,
            alone=alone,
        )
        graphs.warm_up(share.settings.warmup_runs)
        run_cost = None
        if model.dynamic_batching and model.length_aware_batching:
            run_cost = _fitted_run_cost(graphs, share)
        batcher = Batcher(
            graphs.run,
            share.executor,
            workers=model.inference_workers,
            max_batch_size=model.max_batch_size,
            max_queue_size=model.max_queue_size,
            max_queue_delay_s=model.max_queue_delay_us / 1e6,
            enabled=model.dynamic_batching,
            on_batch=on_batch,
            run_cost=run_cost,
            computed_in=graphs.info.computed_in,
            runs_here=_runs_here(graphs, share.quiet),
            board=worker_board(),
            summaries_graph=graphs.has_summaries_graph,
        )
        return cls(graphs, batcher, QueuePolicy.of(model))

    def takes(self, request: InferenceRequest) -> bool:
        return request.sequence_step is None

    async def infer(self, call: Admission, request: InferenceRequest, attention: RunInputs) -> dict[str, np.ndarray]:
        named = tuple(o.name for o in request.outputs)
        num_heads = call.served.signature.num_heads
        q_len, kv_len = attention.query.shape[1], attention.key.shape[1]
        attention.shaping, outputs = weights_shaping(request.parameters, named, num_heads, q_len, kv_len)
        if outputs is not None:
            attention.outputs = outputs
        if call.trace is not None:
            call.trace.decoded(attention, request.id)
        terms = self.queue.terms_of(request)
        answer = await self.batcher.submit(
            attention, call.timeout_s, call.trace, terms, admit=lambda: call.admit(attention, terms.timeout)
        )
        call.ran(answer.run_rows, answer.run_started_ns, queue_ns=answer.queue_ns, infer_ns=answer.infer_ns)
        if self.parity is not None:
            self.parity.offer(request.id, attention, answer.outputs)
        return {name: answer.outputs[name] for name in attention.outputs}

    def describe(self) -> dict[str, object]:
        graphs, batcher = self.graphs, self.batcher
        return {
            "provider": graphs.provider,
            "intra_op_threads": graphs.intra_op_threads,
            # one of --workers: a run's threads while the other workers run nothing (0: always the above)
            "intra_op_threads_alone": graphs.alone_threads,
            "intra_op_spin_ms": graphs.intra_op_spin_ms,
            "inference_workers": batcher.workers,
            "dynamic_batching": batcher.enabled,
            "max_batch_size": batcher.max_batch_size,
            "max_queue_delay_us": batcher.max_queue_delay_us,
            "length_aware_batching": batcher.run_cost is not None,
            "output_only_graph": graphs.has_output_only_graph,
            "summaries_graph": graphs.has_summaries_graph,
            "max_queue_size": batcher.max_queue_size,
            "queue_timeout_us": self.queue.timeout_us,
            "allow_timeout_override": self.queue.allow_override,
            "priority_levels": self.queue.priority_levels,
            "default_priority_level": self.queue.default_priority,
            "parity_share": self.parity.share if self.parity is not None else 0.0,
        }

    def release_memory(self) -> None:
        self.graphs.release_memory()

    def close(self) -> None:
        if self.parity is not None:
            self.parity.close()
        self.graphs = self.batcher = None  # its sessions (weights and arena) go with the last reference


def signature_of(name: str, version: str, batched: BatchedRuntime, serves_sequences: bool) -> ModelSignature:
    """What clients are told of a version: its model, as its full graph describes it."""
    info = batched.graphs.info
    return ModelSignature(
        name,
        version,
        info.d_model,
        info.num_heads,
        info.precision,
        info.max_abs_input,
        serves_sequences,
        info.mask_exact_input_limit,
    )


def _runs_here(graphs: AttentionGraphs, quiet: Callable[[], bool]) -> Callable[[int, int, int], bool] | None:
    """Which lone runs the batcher makes on the event loop: small ones, while no other request is in the server, on
    the CPU (a GPU run's copies and launches are measured for the inference threads only). In one of --workers such
    a run is marked on the workers' board, as the inference threads' runs are, and takes every core's threads where
    the other workers are quiet."""
    if graphs.provider != CPU:
        return None
    d_model = graphs.info.d_model

    def runs_here(rows: int, q_len: int, kv_len: int) -> bool:
        return multiply_adds(rows, q_len, kv_len, d_model) <= RUN_HERE_MAX_MULTIPLY_ADDS and quiet()

    return runs_here


def _fitted_run_cost(graphs: AttentionGraphs, share: ProcessShare) -> RunCost:
    """The run cost of these graphs: fitted at an earlier start of the same on this machine, else fitted now (and
    kept for the next). Kept on the CPU only: a GPU's runs fit in a moment, and its model is not named."""
    limits = share.limits
    shapes = fit_shapes(limits.max_batch_size, limits.max_q_len, limits.max_kv_len)
    key, kept = None, None
    if graphs.provider == CPU:
        threads = [graphs.intra_op_threads, graphs.alone_threads, graphs.intra_op_spin_ms]
        key = share.fitted_costs.key(graph=graphs.graph_sha256, shapes=shapes, threads=threads)
        kept = share.fitted_costs.get(key)
    if kept is not None:
        cost, when = kept
        how = f"fitted at an earlier start on this machine, {when}"
    else:
        d_model = graphs.info.d_model
        rng = np.random.default_rng(0)

        def run(rows: int, q_len: int, kv_len: int) -> None:
            query = rng.standard_normal((rows, q_len, d_model), dtype=np.float32)
            kv = query if kv_len == q_len else rng.standard_normal((rows, kv_len, d_model), dtype=np.float32)
            graphs.run(GRAPH_OUTPUT_NAMES, query, kv, kv, np.ones((1, 1, 1, kv_len), dtype=bool))

        cost, how = RunCost.fit(run, shapes), "fitted at warm-up"
        if key is not None:
            share.fitted_costs.put(key, cost)
    log.info(
        "run cost model (CPU per run, %s): %.0f us + %.1f ns per token + %.2f ns per query-key pair",
        how,
        cost.overhead_s * 1e6,
        cost.per_token_s * 1e9,
        cost.per_pair_s * 1e9,
    )
    return cost
