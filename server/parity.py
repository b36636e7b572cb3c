"""Live parity: a share of served answers recomputed in float64 from the weights in the served ONNX file, off the
request path, and compared within the tolerance the export states for its precision.

The export proves a graph equal to eager PyTorch on a matrix of cases; served traffic is other lengths, masks and
scales, maybe another ONNX Runtime or provider. A checked request's inputs and answer are queued, bounded (a check
never delays a request: when the queue is full the check is dropped and counted), for a process of their own at
the lowest priority (CheckProcess), which recomputes the attention exactly as the module defines it; the error of
each output goes in the version's metrics, a breach of the tolerance also as one log line naming the request.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import pickle
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from mhaserve.contract.signature import ATTN_WEIGHTS, OUTPUT
from mhaserve.protos.generated import onnx_weights_pb2

from .metrics import PARITY_OUTPUTS
from .parameters import NO_SHAPING
from .tensors import RunInputs

log = logging.getLogger("mhaserve.server")

CHECKS_WAITING = 64  # checks queued for the check process at most; past it a check is dropped, and counted
PROJECTIONS = ("q", "k", "v", "o")
# The export's EAGER_ERROR_FACTOR: an answer no further from the exact one than ten times float32 arithmetic of the
# same module is holds, whatever the tolerance (at large input scales float32 itself is far from exact).
FLOAT32_FACTOR = 10
_FLOAT, _INT8, _FLOAT16, _DOUBLE = 1, 3, 10, 11  # onnx.TensorProto.DataType


class ParityUnavailable(Exception):
    """A served graph whose projections this check cannot read, said as why."""


@dataclass(frozen=True)
class ReferenceWeights:
    """The four projections of a served graph in float64, as its ``MatMul`` nodes hold them: ``matmul[p]`` the
    weight transposed ([in, out]: ``x @ matmul[p] + bias[p]``), ``bias[p]``."""

    matmul: dict[str, np.ndarray]
    bias: dict[str, np.ndarray]

    def weight(self, p: str) -> np.ndarray:
        """Projection ``p``'s weight as ``nn.Linear`` holds it ([out, in])."""
        return self.matmul[p].T

    @classmethod
    def from_onnx(cls, path: Path) -> ReferenceWeights:
        """The projections as the graph computes them: the ``Add`` of a bias named after ``W_q``..``W_o`` (either
        case, as the exports name them) after the product with a weight matrix: a float ``MatMul``'s, or an int8
        graph's (export/int8.py), whose weights are the file's int8 values times their column scales, exactly."""
        model = onnx_weights_pb2.ModelProto()
        model.ParseFromString(path.read_bytes())
        initializers = {t.name: t for t in model.graph.initializer}
        produced_by = {out: node for node in model.graph.node for out in node.output}
        matmul, bias = {}, {}
        for node in model.graph.node:
            named = [n for n in node.input if n in initializers and n.lower().endswith(".bias")]
            projection = named[0].lower().rsplit(".", 2)[-2][-1] if node.op_type == "Add" and named else None
            if projection not in PROJECTIONS:
                continue
            product = produced_by.get(next(n for n in node.input if n != named[0]))
            weight = None if product is None else _projection_weight(product, produced_by, initializers)
            if weight is None:
                raise ParityUnavailable(f"the {named[0]} projection is neither a MatMul with a weight matrix nor "
                                        "an int8 one: this graph's answers cannot be recomputed from it")  # fmt: skip
            matmul[projection] = weight
            bias[projection] = _array(initializers[named[0]])
        missing = [p for p in PROJECTIONS if p not in matmul]
        if missing:
            raise ParityUnavailable(f"{path.name} has no W_{missing[0]} projection this check can read")
        return cls(matmul, bias)


def _projection_weight(product, produced_by: dict, initializers: dict) -> np.ndarray | None:
    """The [in, out] weight a projection's product multiplies by, in float64: a ``MatMul``'s initializer, or for an
    int8 product (``MatMulIntegerToFloat`` of int8 weights and their column scales, then a ``Mul`` by the row
    scales) the int8 values times their scales; None for any other product."""
    if product.op_type == "MatMul":
        held = [n for n in product.input if n in initializers]
        return _array(initializers[held[0]]) if held else None
    if product.op_type != "Mul":
        return None
    integer = next((produced_by[n] for n in product.input if n in produced_by
                    and produced_by[n].op_type == "MatMulIntegerToFloat"), None)  # fmt: skip
    if integer is None or not {integer.input[1], integer.input[3]} <= initializers.keys():
        return None
    return _array(initializers[integer.input[1]]) * _array(initializers[integer.input[3]])


def _array(tensor) -> np.ndarray:
    dtype = {_FLOAT: np.float32, _INT8: np.int8, _FLOAT16: np.float16, _DOUBLE: np.float64}.get(tensor.data_type)
    if dtype is None:
        raise ParityUnavailable(f"initializer {tensor.name} is of ONNX type {tensor.data_type}, not a float or int8")
    if tensor.raw_data:
        values = np.frombuffer(tensor.raw_data, dtype=dtype)
    else:
        values = np.asarray(tensor.double_data if dtype is np.float64 else tensor.float_data, dtype=dtype)
    return values.astype(np.float64).reshape(tuple(tensor.dims))


def exact_attention(
    weights: ReferenceWeights, num_heads: int, query, key, value, mask, dtype=np.float64
) -> tuple[np.ndarray, ...]:
    """The module's answer in ``dtype`` (float64: the exact one): per head softmax(Q K^T / sqrt(d_k)) V over the
    keys the mask lets each query row attend (``mask == 0``: may not), concatenated and projected by W_o; a row that
    may attend no key answers zeros, weights and output alike. Returns (output [B, Lq, d], attn_weights
    [B, h, Lq, Lk])."""
    q, k, v = (_heads(_project(weights, x, p, dtype), num_heads) for x, p in ((query, "q"), (key, "k"), (value, "v")))
    shape = (*q.shape[:3], k.shape[2])
    allowed = np.ones(shape, bool) if mask is None else np.broadcast_to(np.asarray(mask) != 0, shape)
    return _attend(weights, q, k, v, allowed, dtype)


def exact_step(
    weights: ReferenceWeights, num_heads: int, query, past_key, past_value, key=None, value=None, cross=False,
    dtype=np.float64,
) -> tuple[np.ndarray, ...]:  # fmt: skip
    """A step of a sequence in ``dtype``: its query rows [B, n, d] over the keys and values the server holds for the
    sequence (``past_key``, ``past_value``: [B, h, P, d_k], projected, as held) and the step's new ones. A
    self-attention step's new keys and values are its own rows', each row attending every earlier one and causally
    among the new; a ``cross`` step's are the ``key`` and ``value`` rows it brings (None: none), every query row
    attending every key. Returns (output [B, n, d], attn_weights [B, h, n, P + new])."""
    own = (key, value) if cross else (query, query)
    q = _heads(_project(weights, query, "q", dtype), num_heads)
    past = (np.asarray(past_key, dtype), np.asarray(past_value, dtype))
    if own[0] is not None:
        new = (_heads(_project(weights, x, p, dtype), num_heads) for x, p in zip(own, "kv", strict=True))
        past = tuple(np.concatenate([held, rows], axis=2) for held, rows in zip(past, new, strict=True))
    k, v = past
    rows, keys = q.shape[2], k.shape[2]
    allowed = np.ones((1, 1, rows, keys), bool)
    if not cross:  # row i of the step is key keys - rows + i: it attends that key and every one before
        allowed = np.arange(keys)[None, :] <= np.arange(keys - rows, keys)[:, None]
    return _attend(weights, q, k, v, np.broadcast_to(allowed, (*q.shape[:3], keys)), dtype)


def _project(weights: ReferenceWeights, x, p: str, dtype) -> np.ndarray:
    """``x @ W_p.T + b_p``: in float64 the file's arrays themselves; in float32 (a breach's second look) copies."""
    matmul, bias = weights.matmul[p].astype(dtype, copy=False), weights.bias[p].astype(dtype, copy=False)
    return np.asarray(x, dtype) @ matmul + bias


def _heads(x: np.ndarray, num_heads: int) -> np.ndarray:
    """[B, L, d] -> [B, h, L, d_k]."""
    batch, length, d_model = x.shape
    return x.reshape(batch, length, num_heads, d_model // num_heads).transpose(0, 2, 1, 3)


def _attend(weights: ReferenceWeights, q, k, v, allowed: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Per head softmax(Q K^T / sqrt(d_k)) V over the ``allowed`` keys ([B, h, Lq, Lk]), a row with none zeros;
    the heads concatenated and projected by W_o."""
    batch, _, q_len, d_k = q.shape
    scores = q @ k.transpose(0, 1, 3, 2) / dtype(math.sqrt(d_k))
    scores = np.where(allowed, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    exps = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = exps.sum(axis=-1, keepdims=True)
    attn = np.divide(exps, total, out=np.zeros_like(exps), where=total > 0)
    context = (attn @ v).transpose(0, 2, 1, 3).reshape(batch, q_len, -1)
    output = _project(weights, context, "o", dtype)
    output[~allowed[:, 0].any(axis=-1)] = 0.0  # a row that may attend no key (the mask is the same in every head)
    return output, attn


def _checked(answers: dict[str, np.ndarray], shaping) -> dict[str, np.ndarray]:
    """The answers a check compares: the output, and the attention weights where the request had them whole."""
    return {name: got for name, got in answers.items()
            if name == OUTPUT or (name == ATTN_WEIGHTS and shaping is NO_SHAPING)}  # fmt: skip


@dataclass(frozen=True)
class Bound:
    """How far an output may be from the exact answer: its error relative to the answer's largest magnitude (the
    export's validation judges every input scale so), or absolute where the export states it so for weights."""

    limit: float
    relative: bool

    def error(self, got: np.ndarray, want: np.ndarray) -> float:
        worst = float(np.max(np.abs(got.astype(np.float64) - want))) if want.size else 0.0
        if not self.relative:
            return worst
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        return worst / scale if scale > 0 else worst


# ONNX Runtime's CUDA provider with --cuda-tf32 rounds float32 products' inputs to TF32's 10 bits of mantissa, as
# float16 does: its answers are held to the export's float16 bound (export/validate.py), relative to their magnitude.
TF32_BOUND = Bound(4e-3, relative=True)


def bounds_of(manifest: dict, tf32: bool = False) -> dict[str, Bound]:
    """Each output's bound from the export's stated tolerance: the output's taken relative to its magnitude
    (live inputs come at any scale), the weights' as stated; where the version runs its products in TF32
    (``tf32``), no tighter than TF32_BOUND."""
    tolerance = manifest.get("validation", {}).get("tolerance", {})
    output, weights = tolerance.get("output", {}), tolerance.get("weights", {})
    bounds = {
        "output": Bound(output.get("max_rel") or output.get("max_abs") or 1e-5, relative=True),
        "attn_weights": Bound(weights.get("max_abs") or weights.get("max_rel") or 1e-5,
                              relative=weights.get("max_abs") is None),
    }  # fmt: skip
    if tf32:  # a weight is at most 1: an absolute bound on the weights is compared as it stands
        bounds = {name: max(bound, TF32_BOUND, key=lambda b: b.limit) for name, bound in bounds.items()}
    return bounds


@dataclass
class Check:
    """An answer to check: what it answered (``what``: "request 'id'", and the sequence where it was a step), which
    computation it stands for (``kind``: "attention", exact_attention's, or "step", exact_step's) on which inputs
    (its arguments after the weights and heads), and the outputs to compare. Plain data: it travels to the check
    process."""

    what: str
    kind: str
    inputs: tuple
    answers: dict[str, np.ndarray]  # output and, where the request had them whole, attn_weights


COMPUTATIONS = {"attention": exact_attention, "step": exact_step}


def judge(check: Check, weights: ReferenceWeights, num_heads: int, bounds: dict[str, Bound]) -> dict:
    """``check``'s answers against the exact ones: each output's error, and a line per output that breached its
    bound (empty where none did)."""

    def computed(dtype) -> dict[str, np.ndarray]:
        outputs = COMPUTATIONS[check.kind](weights, num_heads, *check.inputs, dtype=dtype)
        return dict(zip(PARITY_OUTPUTS, outputs, strict=True))

    exact = computed(np.float64)
    float32 = None  # float32 arithmetic of the same module, computed only where the tolerance alone is broken
    errors, breached = {}, []
    for name, got in check.answers.items():
        bound = bounds[name]
        errors[name] = error = bound.error(got, exact[name])
        # As the export's validation judges every input scale: within the tolerance, or no further from the
        # exact answer than FLOAT32_FACTOR times float32 arithmetic of the same module is (large inputs).
        if error <= bound.limit:
            continue
        if float32 is None:
            float32 = computed(np.float32)
        allowed = max(bound.limit, FLOAT32_FACTOR * bound.error(float32[name], exact[name]))
        if not error <= allowed:  # NaN breaches
            worst = np.unravel_index(int(np.nanargmax(np.abs(got - exact[name]))), got.shape)
            breached.append(f"{name} {error:.3g} over {allowed:.3g} at {list(map(int, worst))} "
                            f"({float(got[worst]):.6g}, exactly {float(exact[name][worst]):.6g})")  # fmt: skip
    return {"errors": errors, "breached": breached}


# The check process's numpy products on one thread: OpenBLAS's threads spin after each product, and the checks'
# took ONNX Runtime's cores (1% of requests checked cost a third of the throughput).
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
STOP_WAIT_S = 5.0  # a check process told to stop (its connection closed) ends within this, or is killed
# A check process that exited is started again at most this often: one that dies at every check costs the server
# a start every so often, the checks meanwhile dropped and counted.
RESTART_EVERY_S = 10.0
# Started this many times in a row without once reading the weights (its imports failing, say): live parity off
# rather than a start and a log line every RESTART_EVERY_S for as long as the server runs.
STARTS_UNREADY = 3
CHECK_PROCESS = "from mhaserve.server.parity import serve_checks; serve_checks({fd})"


class CheckProcess:
    """The process that recomputes checked answers, at the lowest priority and on one BLAS thread: a process,
    not a thread of the server's, because a thread holds the server's GIL between numpy calls, and a thread at the
    lowest priority that the kernel keeps off a busy host's cores while it holds it stalls the event loop (up to
    0.4 s: BENCHMARKS.md, "Live parity"). It reads the weights from the served file itself, and nothing waits for it
    but the first check; it ends when its connection closes, the server's exit included. Used from one thread."""

    def __init__(self, graph_path: Path, num_heads: int, bounds: dict[str, Bound]):
        self._setup = (str(graph_path), num_heads, {name: (b.limit, b.relative) for name, b in bounds.items()})
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        with ours, theirs:
            command = [sys.executable, "-c", CHECK_PROCESS.format(fd=theirs.fileno())]
            self._process = subprocess.Popen(command, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                             env={**os.environ, **ONE_BLAS_THREAD})  # fmt: skip
            self._connection = Connection(os.dup(ours.fileno()))
        self._ready = False  # until it says it has read the weights
        self._lost: str | None = None  # its connection, once lost
        self._connection.send(self._setup)  # a few hundred bytes: they wait in the socket until it reads them

    @property
    def ready(self) -> bool:
        """Whether it has said it read the weights (its first check waits for that)."""
        return self._ready

    @property
    def trouble(self) -> str | None:
        """Why the process can check no more (its exit, or its connection lost); None while it can."""
        code = self._process.poll()
        return f"exit code {code}" if code is not None else self._lost

    def restart(self) -> None:
        """Another process in place of this one."""
        self._connection.close()
        if self._process.poll() is None:  # its connection lost, or it is exiting
            self._process.kill()  # reaped later by the subprocess module
        self._start()

    def judge(self, check: Check) -> dict:
        """The check process's verdict on ``check`` (judge's), once it has read the weights: ParityUnavailable,
        saying why, where it could not; OSError or EOFError where it exits meanwhile (``trouble`` says so)."""
        try:
            if not self._ready:
                refused = self._connection.recv()
                if refused is not None:
                    raise ParityUnavailable(refused)
                self._ready = True
            buffers: list[pickle.PickleBuffer] = []
            fields = (check.what, check.kind, check.inputs, check.answers)  # builtins and arrays: no class by name
            header = pickle.dumps(fields, protocol=5, buffer_callback=buffers.append)
            self._connection.send((header, len(buffers)))
            for buffer in buffers:  # the arrays' own memory, written as it is (the GIL released while it is)
                self._connection.send_bytes(buffer.raw())
            return self._connection.recv()
        except (OSError, EOFError) as error:
            self._lost = f"its connection lost: {error or type(error).__name__}"
            raise

    def close(self) -> None:
        self._connection.close()
        _stopped(self._process)


def _stopped(process: subprocess.Popen) -> None:
    try:
        process.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def serve_checks(fd: int) -> None:
    """The check process (CheckProcess): reads the served file's weights, then judges each check it is sent until
    its connection closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the server's to handle; this ends when the server does
    connection = Connection(fd)
    graph_path, num_heads, bounds = connection.recv()
    try:
        weights = ReferenceWeights.from_onnx(Path(graph_path))
    except ParityUnavailable as why:
        connection.send(str(why))
        return
    except Exception as error:  # the file gone or changed since the load: said, not started again and again
        connection.send(f"{graph_path} could not be read: {type(error).__name__}: {error}")
        return
    # The checks take what the requests leave of the cores: the lowest priority, once the weights are read at the
    # load's (in Linux's idle class from its start, on a host whose cores were all busy, it had not imported numpy a
    # minute later, and in that class it checked nothing there).
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    connection.send(None)
    bounds = {name: Bound(*bound) for name, bound in bounds.items()}
    while True:
        try:
            header, count = connection.recv()
            check = Check(*pickle.loads(header, buffers=[connection.recv_bytes() for _ in range(count)]))
        except EOFError:
            return
        try:
            verdict = judge(check, weights, num_heads, bounds)
        except Exception as error:  # said in the server's log; the next check goes on
            verdict = {"failed": f"{type(error).__name__}: {error}"}
        connection.send(verdict)


class LiveParity:
    """One served version's checks: ``offer`` on the event loop (sampled, queued, never waited for), each check
    handed by a thread of the server's to the check process (CheckProcess) and its verdict recorded in the
    version's metrics."""

    def __init__(self, checker: CheckProcess, share: float, figures, label: str):
        self.share = share
        self.figures = figures  # metrics.ModelMetrics: parity_checks, parity_error
        self.label = label  # "model 'mha' version 1", for the log
        self._checker = checker
        self._next_start = 0.0  # when the check process may be started again, should it exit
        self._exited_unready = 0  # check processes in a row that exited before they had read the weights
        self._waiting: queue.Queue[Check | None] = queue.Queue(CHECKS_WAITING)
        self._sampled = random.Random()
        # each output's largest error checked, recorded by the thread that hands the checks to the process
        self.worst = dict.fromkeys(PARITY_OUTPUTS, 0.0)
        self._thread = threading.Thread(target=self._check_all, name=f"parity {label}", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, graph_path: Path, manifest: dict, num_heads: int, share: float, figures, label: str,
             tf32: bool = False):  # fmt: skip
        """The checks of the version whose full graph is ``graph_path`` (its products in TF32 where ``tf32``); None,
        with a warning saying why, where their process cannot start (one whose weights cannot be read turns live
        parity off at its first check)."""
        try:
            checker = CheckProcess(graph_path, num_heads, bounds_of(manifest, tf32))
        except OSError as why:
            log.warning("%s: live parity off: its check process could not start: %s", label, why)
            return None
        return cls(checker, share, figures, label)

    def offer(self, request_id: str, inputs: RunInputs, answers: dict[str, np.ndarray]) -> None:
        """A served answer, checked with probability ``share``: its output, and its attention weights where the
        request had them whole (not cut or ranked); dropped (and counted) when the checks are behind."""
        if self._sampled.random() >= self.share:
            return
        computed_from = (inputs.query, inputs.key, inputs.value, inputs.mask)
        self._queue(Check(f"request {request_id!r}", "attention", computed_from, _checked(answers, inputs.shaping)))

    def offer_step(
        self, request_id: str, sequence: str, inputs: RunInputs, held: Callable[[], tuple], cross: bool,
        answers: dict[str, np.ndarray],
    ) -> None:  # fmt: skip
        """A step of ``sequence``, answered, checked with probability ``share`` as ``offer`` checks a request: over
        the keys and values the sequence held before it (``held()``: [B, h, P, d_k] each, on the host; asked only
        for a step checked) and its new ones (a cross-attention step's ``inputs.key`` and ``inputs.value``)."""
        if self._sampled.random() >= self.share:
            return
        new = (inputs.key, inputs.value) if cross and inputs.key is not inputs.query else (None, None)
        computed_from = (inputs.query, *held(), *new, cross)
        self._queue(Check(f"request {request_id!r} (a step of sequence {sequence!r})", "step", computed_from,
                          _checked(answers, inputs.shaping)))  # fmt: skip

    def _queue(self, check: Check) -> None:
        if not check.answers:
            return
        try:
            self._waiting.put_nowait(check)
        except queue.Full:
            self.figures.parity_checks["dropped"].value += 1

    def summary(self) -> dict[str, object]:
        """The checks so far, as the version's statistics give them: the share asked, the checks by outcome, those
        still pending, and each output's largest error (as judged: relative to the answer's magnitude for the
        output)."""
        counted = {outcome: int(counter.value) for outcome, counter in self.figures.parity_checks.items()}
        return {"share": self.share, **counted, "checked": counted["held"] + counted["breached"],
                "pending": self._waiting.unfinished_tasks, "worst_error": dict(self.worst)}  # fmt: skip

    def close(self) -> None:
        """No more checks: those waiting are let go, and the check process ends after the one under way."""
        with contextlib.suppress(queue.Empty):
            while True:
                self._waiting.get_nowait()
                self._waiting.task_done()
        self._waiting.put_nowait(None)

    def _check_all(self) -> None:
        while (check := self._waiting.get()) is not None:
            try:
                if self.share and self._checker_up():
                    self._record(check, self._checker.judge(check))
                    self._exited_unready = 0
                else:
                    self.figures.parity_checks["dropped"].value += 1
            except ParityUnavailable as why:  # the served file's weights cannot be read: nothing to check against
                self._turn_off(str(why))
            except (OSError, EOFError):  # the process exited during the check: another starts at the next
                self._exited_unready = 0 if self._checker.ready else self._exited_unready + 1
                if self._exited_unready < STARTS_UNREADY:
                    self.figures.parity_checks["dropped"].value += 1
                else:
                    self._turn_off(
                        f"its check process exited before it had read the weights, {STARTS_UNREADY} times in a row "
                        f"({self._checker.trouble}; its own error, if it said one, is in this server's log above)"
                    )
            except Exception:  # a check must never end the thread, nor touch the request
                log.exception("%s: a parity check of %s failed", self.label, check.what)
            finally:
                self._waiting.task_done()  # no longer pending
        self._checker.close()

    def _turn_off(self, why: str) -> None:
        self.share = 0.0  # none offered from now on, none of those waiting made
        self.figures.parity_checks["dropped"].value += 1
        log.warning("%s: live parity off: %s", self.label, why)

    def _checker_up(self) -> bool:
        """Whether the check process can check: one that stopped is started again, once every RESTART_EVERY_S at
        most (the checks meanwhile dropped)."""
        trouble = self._checker.trouble
        if trouble is None:
            return True
        if time.monotonic() < self._next_start:
            return False
        self._next_start = time.monotonic() + RESTART_EVERY_S
        log.warning("%s: the parity check process stopped (%s); starting another", self.label, trouble)
        try:
            self._checker.restart()
        except OSError as why:
            log.warning("%s: the parity check process could not start (%s); checks dropped, tried again in %g s",
                        self.label, why, RESTART_EVERY_S)  # fmt: skip
            return False
        return True

    def _record(self, check: Check, verdict: dict) -> None:
        if "failed" in verdict:
            log.error("%s: a parity check of %s failed: %s", self.label, check.what, verdict["failed"])
            return
        for name, error in verdict["errors"].items():
            self.figures.parity_error[name].observe(error)
            self.worst[name] = max(self.worst[name], error)
        self.figures.parity_checks["breached" if verdict["breached"] else "held"].value += 1
        if verdict["breached"]:
            log.warning("%s: parity breached by %s: %s", self.label, check.what, "; ".join(verdict["breached"]))
