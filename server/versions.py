"""Served versions made and taken apart: a model folder becomes a ``ServedModel`` (its settings, its runtimes
over the graphs they opened, warmed up, its metrics and statistics), and a retired one gives its memory back.
The registry owns the factory and calls it to load and unload; nothing here calls back up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path

from mhaserve.contract.cache import cache_root
from mhaserve.contract.repository import VersionPolicy

from .config import ServerSettings
from .malloc import release_free_memory
from .memory import MemoryBudget, run_workspace_bytes
from .metrics import Metrics
from .model_config import ModelSettings, model_settings
from .model_folder import ModelFolder
from .parity import LiveParity
from .registry import ServedModel
from .run_cost import FittedCosts
from .runtime import BatchedRuntime, ProcessShare, signature_of
from .sequences import SequenceRuntime, Sequences, StepRun
from .statistics import BatchResult, ModelStatistics
from .tensors import Limits
from .threads import lowered_pool

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
        self.budget = budget
        self.metrics = metrics
        self.sequences = sequences  # the process's live sequences, every version's steps belong to
        self.message_limits: tuple[int, int] | None = None  # (receive, send) the transport bound with
        # Loads get their own thread, so that a version loaded under load does not hold the inference
        # workers for its seconds of session creation and warm-up (at the same lowered priority).
        self._loader = lowered_pool(1, "load", settings.inference_nice)
        fitted_costs = FittedCosts(cache_root() / "run-costs" if settings.run_cost_cache else None)
        self.share = ProcessShare(settings, executor, limits, quiet, fitted_costs)

    async def load(
        self, name: str, number: int, model_dir: Path, config_dir: Path, config_json: str | None = None
    ) -> ServedModel:
        """Version ``number`` of ``name`` from ``model_dir``, served as ``config_dir``'s config.pbtxt (or
        ``config_json``, the load request's) says, the server's settings where it says nothing: its settings, its
        folder checked, its runtimes built over the folder's graphs, and the signature they describe."""
        model = model_settings(self.settings, config_dir, name, config_json=config_json)
        if model.dynamic_batching:
            self.budget.provide_for(model.max_batch_size, padded_runs=not model.length_aware_batching)
        version, stats = str(number), ModelStatistics()
        batched: BatchedRuntime | None = None
        model_metrics = self.metrics.for_model(name, version, lambda: batched.batcher.queue_depth if batched else 0)
        on_batch = self._on_batch(stats, model_metrics, lambda: batched.graphs.info)
        on_step_runs = self._on_step_runs(stats, model_metrics)
        loop = asyncio.get_running_loop()
        label = f"model '{name}' version {version}"
        batched, steps = await loop.run_in_executor(
            self._loader, self._build_runtimes, model_dir, model, on_batch, on_step_runs, model_metrics, label
        )
        signature = signature_of(name, version, batched, steps.serves_sequences)
        self._log_loaded(signature, batched, model, model_dir)
        return ServedModel(signature, model_dir, model, batched, steps, model_metrics, stats)

    def version_policy(self, name: str, config_dir: Path, config_json: str | None = None) -> VersionPolicy | None:
        """The versions ``config_dir``'s config.pbtxt (or ``config_json``) serves; None where it sets no policy.
        Read at every load and poll: what it reads past is said in the log only when a version loads."""
        model = model_settings(self.settings, config_dir, name, quiet=True, config_json=config_json)
        return VersionPolicy.parse(model.version_policy) if "version_policy" in model.configured else None

    def _build_runtimes(
        self,
        model_dir: Path,
        model: ModelSettings,
        on_batch: Callable[[BatchResult], None],
        on_step_runs: Callable[[list[StepRun]], None],
        model_metrics,
        label: str,
    ) -> tuple[BatchedRuntime, SequenceRuntime]:
        """On the loader's thread: the folder read and checked, and the runtimes built over its graphs (the
        batched one with live parity where ``model`` asks for it)."""
        folder = ModelFolder.read(model_dir, self.settings.device)
        batched = BatchedRuntime.build(folder, model, self.share, on_batch)
        if model.parity_share > 0:  # held to the bound of the arithmetic the graphs got (TF32 on CUDA, if asked)
            num_heads = int(folder.manifest["config"]["num_heads"])
            batched.parity = LiveParity.open(folder.graph_path, folder.manifest, num_heads, model.parity_share,
                                             model_metrics, label, tf32=batched.graphs.computes_in_tf32)  # fmt: skip
        steps = SequenceRuntime.build(batched.graphs, model, self.sequences, self.share, batched.parity, on_step_runs)
        return batched, steps

    def _on_batch(self, stats: ModelStatistics, model_metrics, info) -> Callable[[BatchResult], None]:
        """What each finished run of the version's batcher records: its statistics, metrics and workspace."""

        labels = model_metrics.labels  # (model, version)

        def on_batch(run: BatchResult) -> None:
            stats.record_execution(run)
            if log.isEnabledFor(logging.DEBUG):  # verbose: each run's make-up
                log.debug("model '%s' version %s ran %d rows padded to [%d, %d] (padding %.0f%%) in %.3f ms",
                          *labels, run.batch_size, run.q_len, run.kv_len, 100 * run.padding_ratio,
                          run.model_ns / 1e6)  # fmt: skip
            model_metrics.batch_done(run.batch_size, run.padding_ratio)
            d_model, num_heads = info().d_model, info().num_heads
            self.budget.run_made(run_workspace_bytes(run.batch_size, run.q_len, run.kv_len, d_model, num_heads))

        return on_batch

    def _on_step_runs(self, stats: ModelStatistics, model_metrics) -> Callable[[list[StepRun]], None]:
        """What the runs of the version's step graphs record: executions in its statistics and metrics, as its
        batcher's runs are (Triton counts a sequence batcher's runs the same way)."""

        labels = model_metrics.labels  # (model, version)

        def on_runs(runs: list[StepRun]) -> None:
            self.metrics.step_runs_made(len(runs))
            for run in runs:
                stats.record_run(run.rows, input_ns=0, infer_ns=run.ns, output_ns=0)
                model_metrics.batch_done(run.rows)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("model '%s' version %s ran steps of %d rows in %.3f ms", *labels, run.rows, run.ns / 1e6)

        return on_runs

    def _log_loaded(self, signature, batched: BatchedRuntime, model: ModelSettings, model_dir: Path) -> None:
        name, version = signature.name, signature.version
        needed = self.settings.message_limits(signature.d_model, signature.num_heads)
        if self.message_limits and any(n > bound for n, bound in zip(needed, self.message_limits, strict=True)):
            log.warning(
                "model '%s' version %s (d_model %d) allows requests/responses of %d/%d bytes, over the message "
                "limits bound at start (%d/%d): its largest calls will be refused; restart, or set --max-message-bytes",
                name, version, signature.d_model, *needed, *self.message_limits,
            )  # fmt: skip
        configured = f" configured by {model.source}" if model.source else ""
        graphs = batched.graphs
        log.info(
            "loaded model=%s version=%s d_model=%d heads=%d precision=%s opset=%s provider=%s output_only_graph=%s "
            "summaries_graph=%s from %s%s",
            name, version, signature.d_model, signature.num_heads, signature.precision, graphs.info.opset,
            graphs.provider, "yes" if graphs.has_output_only_graph else "no",
            "yes" if graphs.has_summaries_graph else "no", model_dir, configured,
            extra={"model": name, "version": str(version)},
        )  # fmt: skip

    async def unload(self, served: ServedModel) -> None:
        self.metrics.forget(served.metrics)
        # The registry drops its last reference after this returns; the graphs (their weights and ONNX Runtime's
        # arena) are freed with it, and the allocator is then asked to give the pages back.
        for runtime in served.runtimes:
            runtime.close()
        loop = asyncio.get_running_loop()

        def release_later() -> None:
            with contextlib.suppress(RuntimeError):  # the server stopped meanwhile: its loader is shut down
                loop.run_in_executor(self._loader, release_free_memory)

        loop.call_soon(release_later)

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
