"""ONNX Runtime sessions opened on the device that is really usable: their options (one CPU arena for the process),
the CUDA provider tried and proven, and a CUDA run's inputs copied up once (``run_bound``)."""

from __future__ import annotations

import contextlib
import ctypes
import io
import logging
import os
import re
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

from mhaserve.contract.model_dir import ModelDirError
from mhaserve.contract.signature import OUTPUT

log = logging.getLogger("mhaserve.server")

CUDA = "CUDAExecutionProvider"
CPU = "CPUExecutionProvider"


class DeviceUnavailable(RuntimeError):
    """--device cuda was asked for and the CUDA provider is not active in a session."""


_CPU_ARENA_SHARED = False


def _share_cpu_arena() -> None:
    """One CPU arena for the process's sessions, grown by what a run asks for. A session's own arena grows
    in powers of two and keeps every region, about twice what the runs need (BENCHMARKS.md,
    "Figures behind the server's defaults"). Shared, the versions of a repository reuse each other's space."""
    global _CPU_ARENA_SHARED
    if not _CPU_ARENA_SHARED:
        same_as_requested = 1
        memory = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(memory, ort.OrtArenaCfg(0, same_as_requested, -1, -1))
        _CPU_ARENA_SHARED = True


def session_options(intra_op_threads: int, inter_op_threads: int, intra_op_spin_ms: float) -> ort.SessionOptions:
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


def open_session(path: Path, options: ort.SessionOptions, device: str, cuda_tf32: bool = False) -> ort.InferenceSession:
    """``path``'s graph in a session on ``device`` (auto: CUDA where it is usable, else the CPU, saying why once);
    ModelDirError where ONNX Runtime cannot load the file, DeviceUnavailable where cuda was asked for and is not
    usable."""
    try:
        return _create(path, options, device, cuda_tf32)
    except DeviceUnavailable:
        raise
    except Exception as error:  # ONNX Runtime's own kinds (InvalidProtobuf, Fail, ...): a broken file
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ModelDirError(f"{path}: ONNX Runtime cannot load it: {first}") from None


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
