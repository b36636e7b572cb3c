"""Served versions made and taken apart: a model folder becomes a ``ServedModel`` (its ONNX Runtime session,
warmed up, its fitted run cost, its batcher, metrics and statistics), and a retired one gives its memory
back. The registry owns the factory and calls it to load and unload; nothing here calls back up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

import numpy as np

from mhaserve.contract.cache import cache_root
from mhaserve.contract.signature import GRAPH_OUTPUT_NAMES, ModelSignature

from .batcher import Batcher
from .config import ServerSettings
from .malloc import release_free_memory
from .memory import MemoryBudget, run_workspace_bytes
from .metrics import Metrics
from .model_config import ModelSettings, model_settings
from .registry import ServedModel
from .run_cost import RUN_HERE_MAX_MULTIPLY_ADDS, FittedCosts, RunCost, fit_shapes, multiply_adds
from .runtime import BatchedRuntime
from .sequences import SequenceRuntime, Sequences, StepRuns
from .session import CPU, AttentionSession
from .statistics import BatchResult, ModelStatistics
from .tensors import Limits
from .threads import lowered_pool, runs_alone, worker_board

log = logging.getLogger("mhaserve.server")


class VersionFactory:
    """Loads a version into the process's shared inference workers, memory budget and metrics."""

    def __init__(
        self,
        settings: ServerSettings,
        limits: Limits,
        budget: MemoryBudget,
        metrics: Metrics,
        executor: Executor,
        sequences: Sequences,
        quiet: Callable[[], bool] = lambda: False,
    ):
        self.settings = settings
        self.limits = limits
        self.budget = budget
        self.metrics = metrics
        self._executor = executor  # the inference workers every version's runs are made on
        self.sequences = sequences  # the process's live sequences, every version's steps belong to
        self._quiet = quiet  # no other request in the server: a lone small run may be made on the event loop
        self.message_limits: tuple[int, int] | None = None  # (receive, send) the transport bound with
        # Loads get their own thread, so that a version loaded under load does not hold the inference
        # workers for its seconds of session creation and warm-up (at the same lowered priority).
        self._loader = lowered_pool(1, "load", settings.inference_nice)
        self.fitted_costs = FittedCosts(cache_root() / "run-costs" if settings.run_cost_cache else None)

    async def load(self, name: str, number: int, model_dir: Path, config_dir: Path) -> ServedModel:
        """Version ``number`` of ``name`` from ``model_dir``, served as ``config_dir``'s config.pbtxt says (the
        server's settings where it says nothing)."""
        loop = asyncio.get_running_loop()
        model = model_settings(self.settings, config_dir, name)
        if model.dynamic_batching:
            self.budget.provide_for(model.max_batch_size, padded_runs=not model.length_aware_batching)
        session, run_cost = await loop.run_in_executor(self._loader, self._open_session, model_dir, model)
        version = str(number)
        stats = ModelStatistics()
        batcher: Batcher | None = None
        model_metrics = self.metrics.for_model(name, version, lambda: batcher.queue_depth if batcher else 0)

        def on_batch(run: BatchResult) -> None:
            stats.record_execution(run)
            model_metrics.batch_done(run.batch_size, run.padding_ratio)
            self.budget.run_made(
                run_workspace_bytes(run.batch_size, run.q_len, run.kv_len, session.info.d_model, session.info.num_heads)
            )

        batcher = Batcher(
            session.run,
            self._executor,
            workers=model.inference_workers,
            max_batch_size=model.max_batch_size,
            max_queue_size=model.max_queue_size,
            max_queue_delay_s=model.max_queue_delay_us / 1e6,
            enabled=model.dynamic_batching,
            on_batch=on_batch,
            run_cost=run_cost,
            computed_in=session.info.computed_in,
            runs_here=self._runs_here(session),
            board=worker_board(),
        )
        info = session.info
        signature = ModelSignature(
            name,
            version,
            info.d_model,
            info.num_heads,
            info.precision,
            info.max_abs_input,
            session.serves_sequences,
            info.mask_exact_input_limit,
        )
        needed = self.settings.message_limits(signature.d_model, signature.num_heads)
        if self.message_limits and any(n > bound for n, bound in zip(needed, self.message_limits, strict=True)):
            log.warning(
                "model '%s' version %s (d_model %d) allows requests/responses of %d/%d bytes, over the message "
                "limits bound at start (%d/%d): its largest calls will be refused; restart, or set --max-message-bytes",
                name, version, signature.d_model, *needed, *self.message_limits,
            )  # fmt: skip
        configured = f" configured by {model.source}" if model.source else ""
        log.info(
            "loaded model=%s version=%s d_model=%d heads=%d precision=%s opset=%s provider=%s output_only_graph=%s "
            "from %s%s",
            name, version, signature.d_model, signature.num_heads, signature.precision, session.info.opset,
            session.provider, "yes" if session.has_output_only_graph else "no", model_dir, configured,
            extra={"model": name, "version": str(version)},
        )  # fmt: skip
        sequence_steps = None
        if session.serves_sequences:
            runs = [
                StepRuns(graph, self._executor, model.max_batch_size, self.metrics.step_runs_made)
                for graph in (session.steps, session.cross_steps)
                if graph is not None
            ]
            sequence_steps = SequenceRuntime(self.sequences, *runs, computed_in=info.computed_in)
        return ServedModel(
            signature,
            model_dir,
            session,
            BatchedRuntime(batcher),
            model_metrics,
            stats,
            sequence_steps=sequence_steps,
            settings=model,
        )

    def _runs_here(self, session: AttentionSession) -> Callable[[int, int, int], bool] | None:
        """Which lone runs the batcher makes on the event loop: small ones, while no other request is in the
        server, on the CPU (a GPU run's copies and launches are measured for the inference threads only). In one of
        --workers such a run is marked on the workers' board, as the inference threads' runs are, and takes every
        core's threads where the other workers are quiet."""
        if session.provider != CPU:
            return None
        d_model, quiet = session.info.d_model, self._quiet

        def runs_here(rows: int, q_len: int, kv_len: int) -> bool:
            return multiply_adds(rows, q_len, kv_len, d_model) <= RUN_HERE_MAX_MULTIPLY_ADDS and quiet()

        return runs_here

    def _open_session(self, model_dir: Path, model: ModelSettings) -> tuple[AttentionSession, RunCost | None]:
        alone_threads, alone = runs_alone()
        session = AttentionSession(
            model_dir,
            self.settings.device,
            model.intra_op_threads,
            cuda_tf32=self.settings.cuda_tf32,
            intra_op_spin_ms=model.intra_op_spin_ms,
            output_only=model.output_only_graph,
            alone_threads=alone_threads,
            alone=alone,
        )
        session.warm_up(self.settings.warmup_runs)
        run_cost = None
        if model.dynamic_batching and model.length_aware_batching:
            run_cost = self._fit_run_cost(session)
        return session, run_cost

    def _fit_run_cost(self, session: AttentionSession) -> RunCost:
        """The run cost of this session's graph: fitted at an earlier start of the same on this machine, else fitted
        now (and kept for the next). On the CPU only: a GPU's runs fit in a moment, and its model is not named."""
        limits = self.limits
        shapes = fit_shapes(limits.max_batch_size, limits.max_q_len, limits.max_kv_len)
        key, kept = None, None
        if session.provider == CPU:
            key = self.fitted_costs.key(
                graph=session.graph_sha256,
                shapes=shapes,
                threads=[session.intra_op_threads, session.alone_threads, session.intra_op_spin_ms],
            )
            kept = self.fitted_costs.get(key)
        if kept is not None:
            cost, when = kept
            how = f"fitted at an earlier start on this machine, {when}"
        else:
            d_model = session.info.d_model
            rng = np.random.default_rng(0)

            def run(rows: int, q_len: int, kv_len: int) -> None:
                query = rng.standard_normal((rows, q_len, d_model), dtype=np.float32)
                kv = query if kv_len == q_len else rng.standard_normal((rows, kv_len, d_model), dtype=np.float32)
                session.run(GRAPH_OUTPUT_NAMES, query, kv, kv, np.ones((1, 1, 1, kv_len), dtype=bool))

            cost, how = RunCost.fit(run, shapes), "fitted at warm-up"
            if key is not None:
                self.fitted_costs.put(key, cost)
        log.info(
            "run cost model (CPU per run, %s): %.0f us + %.1f ns per token + %.2f ns per query-key pair",
            how,
            cost.overhead_s * 1e6,
            cost.per_token_s * 1e9,
            cost.per_pair_s * 1e9,
        )
        return cost

    async def unload(self, served: ServedModel) -> None:
        self.metrics.forget(served.metrics)
        # The registry drops its last reference after this returns; the session (its weights and
        # ONNX Runtime's arena) is freed with it, and the allocator is then asked to give the pages back.
        served.session = None
        served.batched = served.sequence_steps = None
        loop = asyncio.get_running_loop()

        def release_later() -> None:
            with contextlib.suppress(RuntimeError):  # the server stopped meanwhile: its loader is shut down
                loop.run_in_executor(self._loader, release_free_memory)

        loop.call_soon(release_later)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
