"""One ONNX Runtime session for an exported MHA model, on the device that is really usable."""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from mhaserve.contract.cpu import int8_support
from mhaserve.contract.model_dir import (
    METADATA_PREFIX,
    STEP_FILES,
    ModelDirError,
    check_model_file,
    output_only_file,
    read_manifest,
    step_file,
)
from mhaserve.contract.signature import ATTN_WEIGHTS, OUTPUT, PRECISIONS

from .cores import usable_cores
from .sequences.graph import StepGraph

log = logging.getLogger("mhaserve.server")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


class DeviceUnavailable(RuntimeError):
    """--device cuda was asked for and the CUDA provider is not active in a session."""


@dataclass(frozen=True)
class ModelInfo:
    """What the server tells clients about the model, read from the ONNX file's metadata."""

    name: str
    d_model: int
    num_heads: int
    opset: str
    path: Path
    precision: str = "fp32"  # signature.PRECISIONS; exports before float16 were float32
    # The largest input magnitude the export was validated at (its manifest's input scales); None: no limit,
    # for float32, the eager module's own arithmetic.
    max_abs_input: float | None = None
    # The largest query and key magnitude up to which a mask decides exactly (model.mha.mask_exact_input_limit,
    # from the manifest); None for folders exported before it was recorded.
    mask_exact_input_limit: float | None = None

    @property
    def computed_in(self) -> str:
        return {"fp16": "float16"}.get(self.precision, "float32")


_CPU_ARENA_SHARED = False


def _share_cpu_arena() -> None:
    """One CPU arena for the process's sessions, grown by what a run asks for. A session's own arena grows
    in powers of two and keeps every region, about twice what the runs need (BENCHMARKS.md, "Memory per
    request"). Shared, the versions of a repository reuse each other's space."""
    global _CPU_ARENA_SHARED
    if not _CPU_ARENA_SHARED:
        same_as_requested = 1
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, same_as_requested, -1, -1))
        _CPU_ARENA_SHARED = True


def _session_options(intra_op_threads: int, inter_op_threads: int, intra_op_spin_ms: float) -> ort.SessionOptions:
    _share_cpu_arena()
    options = ort.SessionOptions()
    options.add_session_config_entry("session.use_env_allocators", "1")
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = inter_op_threads
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if intra_op_spin_ms == 0:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    elif intra_op_spin_ms > 0:  # else ONNX Runtime's own spin
        spin_us = max(1, round(intra_op_spin_ms * 1000))
        options.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
    return options


# The output-only graph runs where it was measured faster, from 256 keys; below, both graphs take the same time
# within noise (BENCHMARKS.md, "The output-only graph").
OUTPUT_ONLY_FROM_KV_LEN = 256


class AttentionSession:
    """Runs the exported graph, and its output-only graph (export/output_only.py) for runs that fetch only
    the output at OUTPUT_ONLY_FROM_KV_LEN keys or more, where the folder has one and ``output_only`` allows it.
    ``run`` is thread-safe (ONNX Runtime sessions are)."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str = "auto",
        intra_op_threads: int = 0,
        inter_op_threads: int = 1,
        cuda_tf32: bool = False,
        output_only: bool = True,
        intra_op_spin_ms: float = -1.0,
        alone_threads: int = 0,
        alone: Callable[[], bool] | None = None,
    ):
        """``alone_threads`` and ``alone``: on the CPU, the graphs loaded a second time with this many intra-op
        threads, which a run takes where ``alone()`` says so (one of --workers while the others run nothing: a lone
        caller gets every core's threads, and under load each worker keeps its share)."""
        model_dir = Path(model_dir)
        manifest = read_manifest(model_dir)
        if device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
        # The CPU first: on one whose int8 products saturate, the export's failed validation is a consequence.
        if manifest.get("precision") == "int8":  # export/int8.py: its products have CPU kernels only
            support = int8_support()
            if not support.usable:
                raise ModelDirError(f"{model_dir}: {support.message}")
            if support.message is not None:
                log.warning("%s: %s", model_dir, support.message)
            if device == "cuda":
                raise DeviceUnavailable(
                    f"--device cuda: {model_dir} is an int8 export, and ONNX Runtime's CUDA provider has no kernel "
                    "for its uint8 x int8 products (MatMulIntegerToFloat); serve it with --device cpu, or export "
                    "fp16 for the GPU"
                )
            device = "cpu"
        if not manifest.get("valid"):
            raise ModelDirError(
                f"{model_dir}: the export failed validation (manifest 'valid' is false); "
                f"re-export it or check it with 'mhaserve validate {model_dir}'"
            )
        path = check_model_file(model_dir, manifest)
        self.graph_sha256 = manifest["files"]["model_sha256"]  # as check_model_file found the file
        self.intra_op_threads = intra_op_threads or usable_cores()
        self.intra_op_spin_ms = intra_op_spin_ms
        options = _session_options(self.intra_op_threads, inter_op_threads, intra_op_spin_ms)
        self._session = self._load(path, options, device, cuda_tf32)
        self.provider = self._session.get_providers()[0]
        output_only_path = output_only_file(model_dir, manifest) if output_only else None
        self._output_only = None
        if output_only_path is not None:
            # On the provider the full graph got, so both answer alike.
            self._output_only = self._load(
                output_only_path, options, "cpu" if self.provider == CPU else device, cuda_tf32
            )
        self.alone_threads = 0
        self._alone, self._alone_graphs = alone, None
        if alone is not None and alone_threads > self.intra_op_threads and self.provider == CPU:
            alone_options = _session_options(alone_threads, inter_op_threads, intra_op_spin_ms)
            full = self._load(path, alone_options, "cpu", cuda_tf32)
            only = None if output_only_path is None else self._load(output_only_path, alone_options, "cpu", cuda_tf32)
            self._alone_graphs, self.alone_threads = (full, only), alone_threads
        # On the provider the full graph got, as the output-only graph; None: this folder serves no sequences (of
        # that kind). The grouped graphs only on the CPU: on CUDA each step runs alone, its cache on the device.
        paths = [
            step_file(model_dir, manifest, kind) if self.provider == CPU or not kind.startswith("grouped") else None
            for kind in STEP_FILES
        ]
        step_sessions = [
            None if path is None else self._load(path, options, "cpu" if self.provider == CPU else device, cuda_tf32)
            for path in paths
        ]
        # A run with this option gives ONNX Runtime's arenas back the chunks no run is using, at its end.
        self._shrink = ort.RunOptions()
        arenas = "cpu:0;gpu:0" if self.provider == CUDA else "cpu:0"
        self._shrink.add_run_config_entry("memory.enable_memory_arena_shrinkage", arenas)
        meta = self._session.get_modelmeta().custom_metadata_map
        try:
            self.info = ModelInfo(
                name=meta.get(METADATA_PREFIX + "name", manifest.get("name", "mha")),
                d_model=int(meta[METADATA_PREFIX + "d_model"]),
                num_heads=int(meta[METADATA_PREFIX + "num_heads"]),
                opset=meta.get(METADATA_PREFIX + "opset", "?"),
                path=path,
                precision=meta.get(METADATA_PREFIX + "precision", "fp32"),
            )
        except KeyError as missing:
            raise ModelDirError(f"{path}: metadata_props lacks {missing}; export it with 'mhaserve export'") from None
        except ValueError as error:
            raise ModelDirError(f"{path}: metadata_props holds a bad value ({error})") from None
        if self.info.precision not in PRECISIONS:
            raise ModelDirError(
                f"{path}: metadata_props says precision {self.info.precision!r}; this mhaserve serves "
                f"{', '.join(PRECISIONS)}"
            )
        if self.info.precision != "fp32":
            limit = _validated_input_limit(model_dir, manifest, self.info.precision)
            self.info = replace(self.info, max_abs_input=limit)
        mask_limit = manifest.get("mask_exact_input_limit")
        if type(mask_limit) in (int, float) and mask_limit > 0:
            self.info = replace(self.info, mask_exact_input_limit=float(mask_limit))
        else:
            log.warning(
                "%s: exported before mhaserve recorded the input range within which masks decide exactly; inputs "
                "near float32's range could give a masked key the weight. Export it again to have them refused",
                model_dir,
            )
        # Its sequences' steps (server/sequences), where the folder has a step graph: on the full graph's provider.
        step_session, cross_session, grouped_session, grouped_cross_session = step_sessions
        self.steps = self.cross_steps = None
        if step_session is not None and not StepGraph.writes_new_rows(step_session):
            log.warning(
                "%s: exported before sequences' caches were written in place; it serves no sequences. Export it "
                "again to serve them",
                model_dir,
            )
        elif step_session is not None:
            self.steps = StepGraph(step_session, self.info.d_model, self.info.num_heads, grouped_session)
            if cross_session is not None:
                self.cross_steps = StepGraph(
                    cross_session, self.info.d_model, self.info.num_heads, grouped_cross_session
                )

    @property
    def has_output_only_graph(self) -> bool:
        return self._output_only is not None

    @classmethod
    def _load(cls, path: Path, options: ort.SessionOptions, device: str, cuda_tf32: bool) -> ort.InferenceSession:
        try:
            return cls._create(path, options, device, cuda_tf32)
        except DeviceUnavailable:
            raise
        except Exception as error:  # ONNX Runtime's own kinds (InvalidProtobuf, Fail, ...): a broken file
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise ModelDirError(f"{path}: ONNX Runtime cannot load it: {first}") from None

    @staticmethod
    def _create(path: Path, options: ort.SessionOptions, device: str, cuda_tf32: bool) -> ort.InferenceSession:
        if device == "cpu" or (device == "auto" and not gpu_present()):  # no GPU: nothing to try, or to warn of
            return ort.InferenceSession(str(path), options, providers=[CPU])
        if CUDA in ort.get_available_providers():
            _load_pip_cuda_libraries()
            # onnxruntime-gpu lists CUDA as available even when its libraries cannot load; the
            # session then quietly runs on CPU, so the only proof is the session's own providers.
            # ONNX Runtime logs its failed CUDA load as two errors; our one warning below says it plainly.
            ort.set_default_logger_severity(4)
            try:
                cuda = (CUDA, {"use_tf32": "1" if cuda_tf32 else "0"})
                session = ort.InferenceSession(str(path), options, providers=[cuda, CPU])
            finally:
                ort.set_default_logger_severity(2)
            if session.get_providers()[0] == CUDA:
                return session
            reason = _cuda_unusable_reason()
        else:
            reason = f"this onnxruntime build has no CUDA provider (providers: {ort.get_available_providers()})"
        if device == "cuda":
            raise DeviceUnavailable(f"--device cuda: {reason}")
        log.warning("CUDA is not usable, serving on CPU: %s", reason)
        return ort.InferenceSession(str(path), options, providers=[CPU])

    def graph_for(self, output_names, kv_len: int, graphs: tuple | None = None) -> ort.InferenceSession:
        """The graph a run of these outputs over ``kv_len`` keys takes: the output-only one where it serves, of
        ``graphs`` (a full graph and an output-only one or None), by default the set a run takes now (a run alone
        takes the one of every core's threads)."""
        output_only = tuple(output_names) == (OUTPUT,) and kv_len >= OUTPUT_ONLY_FROM_KV_LEN
        if graphs is None:
            alone = self._alone_graphs is not None and self._alone()
            graphs = self._alone_graphs if alone else (self._session, self._output_only)
        full, only = graphs
        return only if output_only and only is not None else full

    def run(self, output_names, query, key, value, mask, graphs: tuple | None = None) -> list[np.ndarray]:
        session = self.graph_for(output_names, key.shape[1], graphs)
        feed = {"query": query, "key": key, "value": value, "mask": mask}
        if self.provider == CUDA and output_only_once_copied(output_names, query, key, value):
            return run_bound(session, list(output_names), feed, self._output_shapes(query, key), "cuda")
        return session.run(list(output_names), feed)

    def _output_shapes(self, query: np.ndarray, key: np.ndarray) -> dict[str, tuple[int, ...]]:
        batch, q_len, d_model = query.shape
        return {OUTPUT: (batch, q_len, d_model), ATTN_WEIGHTS: (batch, self.info.num_heads, q_len, key.shape[1])}

    @property
    def serves_sequences(self) -> bool:
        return self.steps is not None

    def release_memory(self) -> None:
        """Shrink the arena: after a burst of large runs it holds their peak until the process exits. One tiny
        run, with the shrink option, frees it; the next large run pays for growing it again (page faults), so
        this is for idle times."""
        d = self.info.d_model
        x = np.zeros((1, 1, d), np.float32)
        for session in (self._session, self._output_only):
            if session is not None:
                session.run(["output"], {"query": x, "key": x, "value": x, "mask": np.ones((1, 1, 1, 1), bool)},
                            self._shrink)  # fmt: skip

    def warm_up(self, runs: int = 2) -> None:
        """Run at a few shapes so the first client does not pay for ONNX Runtime's lazy set-up (each set of graphs,
        where a run alone takes others)."""
        for graphs in ((self._session, self._output_only), self._alone_graphs):
            if graphs is not None:
                self._warm_up_graphs(runs, graphs)

    def _warm_up_graphs(self, runs: int, graphs: tuple) -> None:
        d = self.info.d_model
        rng = np.random.default_rng(0)
        for batch, q_len, kv_len in ((1, 16, 16), (2, 64, 32)):
            q = rng.standard_normal((batch, q_len, d), dtype=np.float32)
            kv = rng.standard_normal((batch, kv_len, d), dtype=np.float32)
            mask = np.ones((1, 1, 1, kv_len), dtype=bool)
            for _ in range(runs):
                self.run(("output", "attn_weights"), q, kv, kv, mask, graphs)
        if graphs[1] is not None:
            kv = rng.standard_normal((1, OUTPUT_ONLY_FROM_KV_LEN, d), dtype=np.float32)
            for _ in range(runs):
                self.run(("output",), kv, kv, kv, np.ones((1, 1, 1, OUTPUT_ONLY_FROM_KV_LEN), dtype=bool), graphs)


_ELEMENT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}

# Measured on an H100 (BENCHMARKS.md, "On a GPU"): a self-attention run of [8,512,512] fetching the output alone took
# 2.47 ms bound (the query copied up once) against 3.54 by session.run; at [1,16,512] binding cost 0.04 ms more than
# it saved, and with the weights (64 MiB) written into host arrays the run took 23 ms against 8.1.
BIND_FROM_SAVED_BYTES = 1 << 20


def output_only_once_copied(output_names, query: np.ndarray, key: np.ndarray, value: np.ndarray) -> bool:
    """Whether a CUDA run is bound (``run_bound``): it fetches the output alone and its inputs repeat at least
    BIND_FROM_SAVED_BYTES that session.run would copy up again."""
    if tuple(output_names) != (OUTPUT,):
        return False
    repeated = (key.nbytes if key is query else 0) + (value.nbytes if value is query or value is key else 0)
    return repeated >= BIND_FROM_SAVED_BYTES


def run_bound(
    session: ort.InferenceSession, output_names: list[str], feed: dict, shapes: dict, device: str
) -> list[np.ndarray]:
    """One run with its inputs on ``device`` and its outputs written into host arrays of the given shapes.

    Each distinct array is copied to the device once, however many inputs it feeds: a self-attention request is
    one array as query, key and value, which ``session.run`` would copy up three times (on a GPU those host to
    device copies, not the attention, bound mid-sized runs)."""
    binding = session.io_binding()
    on_device = {}
    for name, array in feed.items():
        if id(array) not in on_device:
            on_device[id(array)] = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), device, 0)
        binding.bind_ortvalue_input(name, on_device[id(array)])
    types = {output.name: _ELEMENT_TYPES[output.type] for output in session.get_outputs()}
    answers = [np.empty(shapes[name], types[name]) for name in output_names]
    for name, answer in zip(output_names, answers, strict=True):
        binding.bind_output(name, "cpu", 0, answer.dtype, answer.shape, answer.ctypes.data)
    session.run_with_iobinding(binding)
    return answers


def _validated_input_limit(model_dir: Path, manifest: dict, precision: str) -> float:
    """The input magnitude up to which a reduced-precision export was validated: past it, its answers are
    refused rather than returned wrong."""
    limit = manifest.get("validation", {}).get("input_scales", {}).get("max_abs_input")
    if type(limit) not in (int, float) or not limit > 0:
        raise ModelDirError(
            f"{model_dir}: a {precision} export without a validated input range (exported before mhaserve "
            "validated input scales, when float16 graphs lost accuracy on large inputs); re-export it"
        )
    return float(limit)


def _load_pip_cuda_libraries() -> None:
    """Load the CUDA and cuDNN libraries of ``onnxruntime-gpu[cuda,cudnn]`` before a CUDA session.

    pip puts them under site-packages/nvidia/*/lib, off the dynamic loader's path: in the server-gpu
    image the CUDA provider failed to load on libcublasLt.so.13 until they were preloaded. Where they
    are not installed ONNX Runtime prints one line per missing library; the reason given by
    ``_cuda_unusable_reason`` says the same in one line, so those prints are swallowed.
    """
    if hasattr(ort, "preload_dlls"):  # onnxruntime-gpu >= 1.21
        with contextlib.redirect_stdout(io.StringIO()):
            ort.preload_dlls()


def gpu_present() -> bool:
    """Whether this machine shows a GPU's device node (NVIDIA's /dev/nvidia0.., WSL2's /dev/dxg); where it
    shows none, ``--device auto`` serves on the CPU without trying CUDA or warning about it."""
    try:
        return any(re.fullmatch(r"nvidia\d+|dxg", name) for name in os.listdir("/dev"))
    except OSError:
        return True  # cannot tell: try, and say what failed


def _cuda_unusable_reason() -> str:
    """Why a session asked for CUDA came up on CPU: the library the CUDA provider could not load, if any."""
    provider_library = Path(ort.__file__).parent / "capi" / "libonnxruntime_providers_cuda.so"
    if sys.platform.startswith("linux") and provider_library.exists():
        try:
            ctypes.CDLL(str(provider_library))
        except OSError as error:
            # libcuda.so.1 is the driver, which a container gets from the host (--gpus / the NVIDIA runtime).
            hint = " (the NVIDIA driver: no GPU visible here)" if "libcuda.so" in str(error) else ""
            return f"the CUDA provider did not load: {error}{hint}"
        return "the CUDA provider loaded but created no CUDA session (no usable GPU?)"
    return "the CUDA provider did not load (CUDA or cuDNN libraries missing, or no GPU)"
