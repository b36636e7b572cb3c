"""The full attention graphs of a served version, as its batched runtime runs them: the exported graph, its
output-only graph (export/output_only.py) for runs that fetch only the output over OUTPUT_ONLY_FROM_KV_LEN keys or
more, its summaries graph (export/summaries.py) for runs that fetch the weights' summaries and no weights, and, in
one of --workers on the CPU, the same set with every core's threads for a run made alone."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

from mhaserve.contract.signature import ATTN_WEIGHTS, OUTPUT, SUMMARY_OUTPUT_NAMES

from .cores import usable_cores
from .model_folder import ModelFolder
from .session import CPU, CUDA, open_session, output_only_once_copied, run_bound, session_options

# The output-only graph runs where it was measured faster, from 256 keys; below, both graphs take the same time
# within noise (BENCHMARKS.md, "Attention weights shaped per request").
OUTPUT_ONLY_FROM_KV_LEN = 256

# One set of graphs: the full one, the output-only one or None, and the summaries one or None.
GraphSet = tuple[ort.InferenceSession, ort.InferenceSession | None, ort.InferenceSession | None]


class AttentionGraphs:
    """Runs a folder's full graph, and its output-only and summaries graphs where the folder has them and
    ``output_only`` and ``summaries`` allow them. ``run`` is thread-safe (ONNX Runtime sessions are)."""

    def __init__(
        self,
        folder: ModelFolder,
        intra_op_threads: int = 0,
        inter_op_threads: int = 1,
        cuda_tf32: bool = False,
        output_only: bool = True,
        summaries: bool = True,
        intra_op_spin_ms: float = -1.0,
        alone_threads: int = 0,
        alone: Callable[[], bool] | None = None,
    ):
        """``alone_threads`` and ``alone``: on the CPU, the graphs loaded a second time with this many intra-op
        threads, which a run takes where ``alone()`` says so (one of --workers while the others run nothing: a lone
        caller gets every core's threads, and under load each worker keeps its share)."""
        self.folder = folder
        self.graph_sha256 = folder.graph_sha256
        self.intra_op_threads = intra_op_threads or usable_cores()
        self.intra_op_spin_ms = intra_op_spin_ms
        self.cuda_tf32 = cuda_tf32
        # What every graph of this version is opened with: the step graphs too (sequences.SequenceRuntime).
        self.options = session_options(self.intra_op_threads, inter_op_threads, intra_op_spin_ms)
        full = open_session(folder.graph_path, self.options, folder.device, cuda_tf32)
        self.provider = full.get_providers()[0]
        # The device every other graph of this version opens on: the one the full graph got, so all answer alike.
        self.device = "cpu" if self.provider == CPU else folder.device
        output_only_path = folder.output_only_path() if output_only else None
        summaries_path = folder.summaries_path() if summaries else None
        self._graphs: GraphSet = (
            full,
            self._open(output_only_path, self.options),
            self._open(summaries_path, self.options),
        )
        self.alone_threads = 0
        self._alone, self._alone_graphs = alone, None
        if alone is not None and alone_threads > self.intra_op_threads and self.provider == CPU:
            alone_options = session_options(alone_threads, inter_op_threads, intra_op_spin_ms)
            full_alone = open_session(folder.graph_path, alone_options, "cpu", cuda_tf32)
            self._alone_graphs = (
                full_alone,
                self._open(output_only_path, alone_options),
                self._open(summaries_path, alone_options),
            )
            self.alone_threads = alone_threads
        # A run with this option gives ONNX Runtime's arenas back the chunks no run is using, at its end.
        self._shrink = ort.RunOptions()
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", self._arenas())
        self.info = folder.info(full.get_modelmeta().custom_metadata_map)

    @classmethod
    def open(cls, model_dir: str | Path, device: str = "auto", **options) -> AttentionGraphs:
        """The graphs of the folder at ``model_dir``, read and checked (model_folder.ModelFolder.read)."""
        return cls(ModelFolder.read(model_dir, device), **options)

    def open_graph(self, path: Path | None) -> ort.InferenceSession | None:
        """Another graph of this folder (a step graph), on this version's device with its options."""
        return self._open(path, self.options)

    def _open(self, path: Path | None, options: ort.SessionOptions) -> ort.InferenceSession | None:
        return None if path is None else open_session(path, options, self.device, self.cuda_tf32)

    def _arenas(self) -> str:
        return "cpu:0;gpu:0" if self.provider == CUDA else "cpu:0"

    @property
    def computes_in_tf32(self) -> bool:
        """Whether the CUDA provider runs the float32 products in TF32 (--cuda-tf32)."""
        return self.provider == CUDA and self.cuda_tf32

    @property
    def has_output_only_graph(self) -> bool:
        return self._graphs[1] is not None

    @property
    def has_summaries_graph(self) -> bool:
        return self._graphs[2] is not None

    def graph_for(self, output_names, kv_len: int, graphs: GraphSet | None = None) -> ort.InferenceSession:
        """The graph a run of these outputs over ``kv_len`` keys takes: the summaries one for summaries (the batcher
        asks for them only where it exists), the output-only one where it serves, of ``graphs``, by default the set
        a run takes now (a run alone takes the one of every core's threads)."""
        output_only = tuple(output_names) == (OUTPUT,) and kv_len >= OUTPUT_ONLY_FROM_KV_LEN
        if graphs is None:
            alone = self._alone_graphs is not None and self._alone()
            graphs = self._alone_graphs if alone else self._graphs
        full, only, summarised = graphs
        if summarised is not None and any(name in SUMMARY_OUTPUT_NAMES for name in output_names):
            return summarised
        return only if output_only and only is not None else full

    def run(self, output_names, query, key, value, mask, graphs: GraphSet | None = None) -> list[np.ndarray]:
        session = self.graph_for(output_names, key.shape[1], graphs)
        feed = {"query": query, "key": key, "value": value, "mask": mask}
        if self.provider == CUDA and output_only_once_copied(output_names, query, key, value):
            return run_bound(session, list(output_names), feed, self._output_shapes(query, key), "cuda")
        return session.run(list(output_names), feed)

    def _output_shapes(self, query: np.ndarray, key: np.ndarray) -> dict[str, tuple[int, ...]]:
        batch, q_len, d_model = query.shape
        return {OUTPUT: (batch, q_len, d_model), ATTN_WEIGHTS: (batch, self.info.num_heads, q_len, key.shape[1])}

    def release_memory(self) -> None:
        """Shrink the arena: after a burst of large runs it holds their peak until the process exits. One tiny
        run, with the shrink option, frees it; the next large run pays for growing it again (page faults), so
        this is for idle times."""
        x = np.zeros((1, 1, self.info.d_model), np.float32)
        feed = {"query": x, "key": x, "value": x, "mask": np.ones((1, 1, 1, 1), bool)}
        for session in self._graphs:
            if session is not None:
                session.run([OUTPUT], feed, self._shrink)

    def warm_up(self, runs: int = 2) -> None:
        """Run at a few shapes so the first client does not pay for ONNX Runtime's lazy set-up (each set of graphs,
        where a run alone takes others)."""
        for graphs in (self._graphs, self._alone_graphs):
            if graphs is not None:
                self._warm_up_graphs(runs, graphs)

    def _warm_up_graphs(self, runs: int, graphs: GraphSet) -> None:
        d = self.info.d_model
        rng = np.random.default_rng(0)
        for batch, q_len, kv_len in ((1, 16, 16), (2, 64, 32)):
            q = rng.standard_normal((batch, q_len, d), dtype=np.float32)
            kv = rng.standard_normal((batch, kv_len, d), dtype=np.float32)
            mask = np.ones((1, 1, 1, kv_len), dtype=bool)
            for _ in range(runs):
                self.run((OUTPUT, ATTN_WEIGHTS), q, kv, kv, mask, graphs)
        if graphs[1] is not None:
            kv = rng.standard_normal((1, OUTPUT_ONLY_FROM_KV_LEN, d), dtype=np.float32)
            for _ in range(runs):
                self.run((OUTPUT,), kv, kv, kv, np.ones((1, 1, 1, OUTPUT_ONLY_FROM_KV_LEN), dtype=bool), graphs)
        if graphs[2] is not None:
            q = rng.standard_normal((1, 16, d), dtype=np.float32)
            for _ in range(runs):
                self.run((OUTPUT, *SUMMARY_OUTPUT_NAMES), q, q, q, np.ones((1, 1, 1, 16), dtype=bool), graphs)
