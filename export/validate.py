"""Prove an ONNX export computes what an eager module computes, case by case over a shape matrix.

Each case draws fresh random inputs, runs the eager reference (float32) and ONNX Runtime (CPU) and compares both
outputs; graphs that answer the same requests (a folder's full graph and its output-only graph) are validated in one
pass, each case drawn and answered by the reference once for all of them. The reference is the served module
(``ServedModuleReference``: it gets the mask in the rank a user would pass, key padding [B, Lk], causal [1, Lq, Lk],
full [B, Lq, Lk]) or the user's own module (``UserModuleReference``: the design documents' interface, the mask in
the rank-4 form [B|1, 1, Lq|1, Lk] that broadcasts against its scores in any such module). The ONNX side always gets
the served rank-4 form.

A query row whose keys are all masked is defined by the served graph as zeros. A user's module may
leave it undefined (NaN, from a -inf fill) or define it otherwise (uniform weights, from a finite
fill): such a case is compared on every other row and reported as "undefined", neither a pass nor
a failure.
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from mhaserve.contract.errors import UsageError
from mhaserve.model import MultiHeadAttention, causal_mask

TOLERANCE = 1e-5  # max abs error, float32; a correct export measures <= 1e-6
BATCHES = (1, 2, 7)
Q_LENS = (1, 5, 64, 300)
MASKS = ("none", "key_padding", "causal", "masked_row")
# (batch, Lq, Lk) with Lq != Lk: cross-attention, including length 1 on either side.
CROSS_SHAPES = ((1, 1, 300), (2, 5, 64), (7, 64, 5), (2, 300, 1), (7, 1, 5))


@dataclass(frozen=True)
class ValidationCase:
    batch: int
    q_len: int
    kv_len: int
    mask: str

    @property
    def kind(self) -> str:
        return "self" if self.q_len == self.kv_len else "cross"


@dataclass(frozen=True)
class Bound:
    """How far one output may be from the reference: an absolute error, or one relative to the reference's
    largest magnitude."""

    max_abs: float | None = None  # the largest absolute error
    max_rel: float | None = None  # the largest absolute error over the reference's largest magnitude

    @property
    def limit(self) -> float:
        return self.max_abs if self.max_abs is not None else self.max_rel

    def judged(self, max_abs: float, max_rel: float) -> float:
        """The one of the two errors this bound holds to its limit."""
        return max_abs if self.max_abs is not None else max_rel

    def allows(self, max_abs: float, max_rel: float) -> bool:
        # NaN compares false: a NaN anywhere fails the case.
        return self.judged(max_abs, max_rel) <= self.limit

    def __str__(self) -> str:
        if self.max_abs is not None:
            return f"max abs error <= {self.max_abs:g}"
        return f"max abs error <= {self.max_rel:g} x the reference's largest magnitude"


@dataclass(frozen=True)
class Tolerance:
    """How far an export's answers may be from the float32 eager reference's: the output and the attention
    weights, each by its own bound."""

    output: Bound
    weights: Bound

    @classmethod
    def same(cls, bound: Bound) -> Tolerance:
        return cls(bound, bound)

    def __str__(self) -> str:
        if self.output == self.weights:
            return str(self.output)
        return f"output {self.output}; weights {self.weights}"


# float32 is held to its absolute 1e-5. float16 rounds every value to 11 significant bits (a relative
# 4.9e-4), so its error scales with the values: 4e-3 of the largest is about 4 float16 steps there
# (measured at 512/8 and 768/12: 6-7e-4 of it, outputs and weights alike).
# int8 rounds each projection's inputs per token and its weights per output column to 8 bits (export/int8.py):
# the output's error is relative to its magnitude, the weights' is absolute (they are probabilities). Over the
# matrix at 512/8, 768/12 and 4096/32, seeded and trained weights, the worst were 1.5-2.0e-2 of the output and
# 5-6e-3 of a weight (BENCHMARKS.md, "Precision"); the bounds leave 1.5 and 1.7 times that.
TOLERANCES = {
    "fp32": Tolerance.same(Bound(max_abs=TOLERANCE)),
    "fp16": Tolerance.same(Bound(max_rel=4e-3)),
    "int8": Tolerance(output=Bound(max_rel=3e-2), weights=Bound(max_abs=1e-2)),
}

# The same exports are validated at input scales past unit-scale random inputs: hidden states before a
# LayerNorm reach magnitudes of tens and more, where the scores reach thousands and the softmax turns on
# their absolute errors. Errors are taken relative to the reference's largest magnitude at every scale (an
# absolute 1e-5 means nothing for outputs of magnitude 1e4). The largest input magnitude up to which every
# scale held is recorded; the server refuses inputs past it for every precision but float32, the eager
# module's own arithmetic.
INPUT_SCALES = (0.01, 1.0, 3.0, 10.0, 30.0, 100.0, 1000.0, 10000.0)
# Every row of a scale's inputs holds one value of this many standard deviations (scaled_inputs): a Gaussian
# request of 8M values (32 x 512 x 512) reaches about 5.7.
TAIL = 6.0
SCALE_CASES = (
    ValidationCase(2, 64, 64, "none"),
    ValidationCase(2, 64, 64, "causal"),
    ValidationCase(2, 5, 64, "key_padding"),
)
SCALE_TOLERANCES = {
    "fp32": Tolerance.same(Bound(max_rel=TOLERANCE)),
    "fp16": TOLERANCES["fp16"],
    "int8": TOLERANCES["int8"],
}
# Or no further from the exact answer than this many times eager float32 PyTorch is. Where the scores reach
# thousands, float32 itself puts the weights off by up to 1e-3, and two float32 computations in different
# orders (ONNX Runtime's, torch's) differ by several times each other's error from seed to seed (measured
# when it was chosen); a graph rounding the query and key to float16 is hundreds of times off.
EAGER_ERROR_FACTOR = 10

PASS, FAIL, UNDEFINED, SKIPPED = "pass", "fail", "undefined", "skipped"
STATUSES = (PASS, FAIL, UNDEFINED, SKIPPED)


@dataclass
class CaseResult:
    case: ValidationCase
    output_max_abs: float
    output_max_rel: float
    attn_max_abs: float | None  # None: the reference returns no weights
    attn_max_rel: float | None
    status: str  # PASS, FAIL, UNDEFINED (the reference leaves fully masked rows undefined) or SKIPPED
    error: str | None = None  # why it failed, or what the reference gave on fully masked rows

    @property
    def passed(self) -> bool:
        return self.status == PASS

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def as_dict(self) -> dict:
        row = asdict(self.case) | {"kind": self.case.kind}
        row.update({k: v for k, v in asdict(self).items() if k != "case"})
        return row | {"passed": self.passed}


@dataclass(frozen=True)
class CaseInputs:
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    eager_mask: np.ndarray | None  # the rank a user passes ([B, Lk], [1, Lq, Lk], [B, Lq, Lk]) or None
    onnx_mask: np.ndarray  # the served rank-4 form [B|1, 1, Lq|1, Lk]


class ServedModuleReference:
    """The served MultiHeadAttention itself: every case, both outputs, fully masked rows included."""

    self_attention_only = False

    def __init__(self, module: MultiHeadAttention):
        self.module = module.eval()

    def __call__(self, inputs: CaseInputs) -> tuple[np.ndarray, np.ndarray | None]:
        args = (inputs.query, inputs.key, inputs.value, inputs.eager_mask)
        with torch.no_grad():
            output, weights = self.module(*(None if a is None else torch.from_numpy(a) for a in args))
        return output.numpy(), weights.numpy()


class UserModuleReference:
    """A user's module with the design documents' interface: ``forward(query, key, value, mask=None)`` or
    self-attention ``forward(x, mask=None)``, returning the output or ``(output, weights, ...)``."""

    def __init__(self, module: nn.Module):
        self.module = module.eval()
        try:
            parameters = list(inspect.signature(module.forward).parameters.values())
        except (TypeError, ValueError):
            parameters = []
        positional = [
            p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
        ]
        if len(positional) not in (1, 3) or len(parameters) <= len(positional):
            names = ", ".join(p.name for p in parameters)
            raise UsageError(
                f"{type(module).__name__}.forward({names}) is neither forward(query, key, value, mask) nor "
                "forward(x, mask)"
            )
        self.self_attention_only = len(positional) == 1

    def __call__(self, inputs: CaseInputs) -> tuple[np.ndarray, np.ndarray | None]:
        mask = None if inputs.eager_mask is None else torch.from_numpy(inputs.onnx_mask)
        tensors = [torch.from_numpy(inputs.query)]
        if not self.self_attention_only:
            tensors += [torch.from_numpy(inputs.key), torch.from_numpy(inputs.value)]
        with torch.no_grad():
            returned = self.module(*tensors, mask)
        if isinstance(returned, torch.Tensor):
            return returned.float().numpy(), None
        output, weights = returned[0], returned[1] if len(returned) > 1 else None
        return output.float().numpy(), None if weights is None else weights.float().numpy()


def validation_session(graph: bytes | str) -> ort.InferenceSession:
    """A CPU session for validation. Its threads do not spin between runs: between them the eager reference
    computes (and other graphs validated on the same case run), and spinning threads held the cores that work
    needed (a default export's validation took 1.7x as long)."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])


class _Tables:
    """The reports of graphs validated in one pass: the first graph's rows as they come, each other's held until
    the first's table has ended, so that every table is written whole."""

    def __init__(self, reports: list[Callable[[str], None]]):
        self._reports = reports
        self._held: list[list[str]] = [[] for _ in reports]

    def row(self, number: int, line: str) -> None:
        if number == 0:
            self._reports[0](line)
        else:
            self._held[number].append(line)

    def end(self, number: int, summary: str) -> None:
        for line in self._held[number]:
            self._reports[number](line)
        self._reports[number](summary)


def report_to_stderr(line: str) -> None:
    """Where a validation's table rows go when the caller gives no ``report``."""
    print(line, file=sys.stderr, flush=True)


def validation_cases() -> list[ValidationCase]:
    cases = [ValidationCase(b, lq, lq, m) for b in BATCHES for lq in Q_LENS for m in MASKS]
    cases += [ValidationCase(b, lq, lk, m) for b, lq, lk in CROSS_SHAPES for m in MASKS]
    return cases


def make_masks(case: ValidationCase, rng: np.random.Generator) -> tuple[np.ndarray | None, np.ndarray]:
    """(mask for the eager module or None, rank-4 bool mask for the ONNX graph)."""
    b, lq, lk = case.batch, case.q_len, case.kv_len
    if case.mask == "none":
        return None, np.ones((1, 1, 1, lk), dtype=bool)
    if case.mask == "key_padding":
        lengths = rng.integers(1, lk + 1, size=b)
        padding = np.arange(lk)[None, :] < lengths[:, None]  # [B, Lk]
        return padding, padding[:, None, None, :]
    if case.mask == "causal":
        causal = causal_mask(lq, lk).numpy()  # [1, Lq, Lk]: batch broadcasts
        return causal, causal[:, None]
    if case.mask == "masked_row":
        full = rng.random((b, lq, lk)) < 0.7
        full[:, :, 0] = True
        full[0, lq - 1, :] = False  # one query row may attend to nothing
        return full, full[:, None]
    raise ValueError(f"unknown mask kind {case.mask!r}")


class TorchMultiheadAttentionReference:
    """A user's ``nn.MultiheadAttention``: its boolean ``attn_mask`` means True = may not attend, per head."""

    self_attention_only = False

    def __init__(self, module: nn.MultiheadAttention):
        self.module = module.eval()

    def __call__(self, inputs: CaseInputs) -> tuple[np.ndarray, np.ndarray | None]:
        (b, lq, _), lk = inputs.query.shape, inputs.key.shape[1]
        attn_mask = None
        if inputs.eager_mask is not None:
            blocked = ~np.broadcast_to(inputs.onnx_mask, (b, 1, lq, lk))[:, 0]
            attn_mask = torch.from_numpy(np.repeat(blocked, self.module.num_heads, axis=0))  # [B * h, Lq, Lk]
        tensors = [torch.from_numpy(a) for a in (inputs.query, inputs.key, inputs.value)]
        if not self.module.batch_first:
            tensors = [t.transpose(0, 1) for t in tensors]
        with torch.no_grad():
            output, weights = self.module(*tensors, attn_mask=attn_mask, average_attn_weights=False)
        if not self.module.batch_first:
            output = output.transpose(0, 1)
        return output.numpy(), weights.numpy()


def max_errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    """The largest absolute error, and it over the reference's largest magnitude (in float64; NaN anywhere
    propagates into the max and fails the case)."""
    if got.size == 0:
        return 0.0, 0.0
    max_abs = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    scale = float(np.max(np.abs(want))) or 1.0
    return max_abs, max_abs / scale


def _masked_rows_note(got: list[np.ndarray], want: list[np.ndarray]) -> str | None:
    """None if the reference agrees with the served zeros on fully masked rows, else what it gives there."""
    if any(np.isnan(w).any() for w in want):
        return "the reference gives NaN on fully masked rows; the served graph gives zeros"
    if all(g.shape == w.shape and np.allclose(g, w, rtol=0, atol=TOLERANCE) for g, w in zip(got, want, strict=True)):
        return None
    return "the reference defines fully masked rows its own way (e.g. uniform weights); the served graph gives zeros"


def case_inputs(case: ValidationCase, rng: np.random.Generator, d_model: int) -> CaseInputs:
    """A case's random inputs: the query (key and value drawn apart for cross-attention) and its masks."""
    query = rng.standard_normal((case.batch, case.q_len, d_model), dtype=np.float32)
    if case.kind == "self":
        key = value = query
    else:
        key = rng.standard_normal((case.batch, case.kv_len, d_model), dtype=np.float32)
        value = rng.standard_normal((case.batch, case.kv_len, d_model), dtype=np.float32)
    eager_mask, onnx_mask = make_masks(case, rng)
    return CaseInputs(query, key, value, eager_mask, onnx_mask)


def judge_case(
    session: ort.InferenceSession,
    case: ValidationCase,
    inputs: CaseInputs,
    want: tuple[np.ndarray, np.ndarray | None],
    tolerance: Tolerance = TOLERANCES["fp32"],
) -> CaseResult:
    """The graph's answer to a case's ``inputs`` against the reference's, ``want`` (output, weights or None)."""
    nan = float("nan")
    want_out, want_attn = want
    onnx_mask = inputs.onnx_mask
    # The full graph returns the weights too; the output-only graph (output_only.py) just the output.
    names = [o.name for o in session.get_outputs()]
    feed = {"query": inputs.query, "key": inputs.key, "value": inputs.value, "mask": onnx_mask}
    try:
        got_out, *got_attn = session.run(names, feed)
    except Exception as exc:  # an export that cannot run this shape fails the case, not the run
        return CaseResult(case, nan, nan, nan, nan, FAIL, error=str(exc).splitlines()[0][:300])
    pairs = [(got_out, want_out)]
    if got_attn and want_attn is not None:
        pairs.append((got_attn[0], want_attn))
    wrong = [f"{got.shape} where {want.shape} was expected" for got, want in pairs if got.shape != want.shape]
    if wrong:
        return CaseResult(case, nan, nan, nan, nan, FAIL, error="shapes: " + "; ".join(wrong))

    # Rows with some key to attend to are defined alike everywhere; fully masked ones are judged apart.
    attends = np.broadcast_to(onnx_mask.any(axis=-1)[:, 0], (case.batch, case.q_len))
    defined = [max_errors(*_rows_of(g, w, attends)) for g, w in pairs]
    (out_abs, out_rel), (attn_abs, attn_rel) = defined[0], defined[1] if len(defined) > 1 else (None, None)
    bounds = (tolerance.output, tolerance.weights)
    if not all(bound.allows(*errors) for bound, errors in zip(bounds, defined, strict=False)):
        return CaseResult(case, out_abs, out_rel, attn_abs, attn_rel, FAIL)
    note = None
    if not attends.all():
        note = _masked_rows_note(*zip(*(_rows_of(g, w, ~attends) for g, w in pairs), strict=True))
    return CaseResult(case, out_abs, out_rel, attn_abs, attn_rel, UNDEFINED if note else PASS, note)


def _rows_of(got: np.ndarray, want: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The query rows picked by ``rows`` [B, Lq] of an output [B, Lq, d] or weights [B, h, Lq, Lk]."""
    if got.ndim == 3:
        return got[rows], want[rows]
    return got.transpose(0, 2, 1, 3)[rows], want.transpose(0, 2, 1, 3)[rows]


def status_counts(results: list[CaseResult]) -> dict[str, int]:
    """How many cases ended in each status (every status named, zeros included)."""
    return {status: sum(r.status == status for r in results) for status in STATUSES}


def format_row(index: int, total: int, result: CaseResult) -> str:
    c = result.case
    attn = (
        "attn  (not returned)   "
        if result.attn_max_abs is None
        else (f"attn abs {result.attn_max_abs:8.1e} rel {result.attn_max_rel:8.1e}")
    )
    return (
        f"[{index:>3}/{total}] {c.kind:<5} B={c.batch:<2} Lq={c.q_len:<4} Lk={c.kv_len:<4} mask={c.mask:<11} "
        f"output abs {result.output_max_abs:8.1e} rel {result.output_max_rel:8.1e}  {attn}  "
        f"{result.status if result.status != FAIL else 'FAIL'}" + (f"  ({result.error})" if result.error else "")
    )


@dataclass
class ScaleResult:
    """The scale cases at one input scale: the export's worst errors against the exact answer (the served module
    in float64), and eager float32 PyTorch's own; relative errors are over the exact answer's largest magnitude."""

    scale: float
    max_abs_input: float  # the largest input magnitude drawn at this scale
    output_max_rel: float
    attn_max_rel: float | None  # None: the graph returns no weights (the output-only graph)
    eager_output_max_rel: float
    eager_attn_max_rel: float
    passed: bool
    attn_max_abs: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def scaled_inputs(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Gaussian inputs of standard deviation ``scale`` with, in every row, one element of magnitude TAIL x ``scale``:
    the largest magnitude a request's rows reach at that scale does not depend on how many values were drawn (a
    [8, 128, 512] request's largest Gaussian value is larger than a [2, 64, 512] case's), and an export's held
    range (``input_limit``) is tested on rows that reach it."""
    inputs = rng.standard_normal(shape)
    rows = inputs.reshape(-1, shape[-1])
    at = rng.integers(shape[-1], size=rows.shape[0])
    rows[np.arange(rows.shape[0]), at] = np.where(rng.random(rows.shape[0]) < 0.5, -TAIL, TAIL)
    return (inputs * scale).astype(np.float32)


def validate_scales(
    module: MultiHeadAttention,
    onnx_model: bytes | str,
    seed: int | None = None,
    report: Callable[[str], None] | None = None,
    precision: str = "fp32",
) -> list[ScaleResult]:
    """The scale cases at every input scale (INPUT_SCALES), one table row per scale. A scale holds where the
    export is within its precision's tolerance of the exact answer, or no further from it than EAGER_ERROR_FACTOR
    times eager float32 PyTorch is."""
    return validate_scales_graphs(module, [(onnx_model, report or report_to_stderr)], seed, precision)[0]


def validate_scales_graphs(
    module: MultiHeadAttention,
    graphs: list[tuple[bytes | str, Callable[[str], None]]],
    seed: int | None = None,
    precision: str = "fp32",
) -> list[list[ScaleResult]]:
    """``validate_scales`` for graphs that answer the same requests, each given with its report: every scale's
    inputs drawn, and their exact and eager answers computed, once for all of them. The first graph's table is
    reported as it runs, each other's after it. The results, a list per graph."""
    tolerance = SCALE_TOLERANCES[precision]
    module = module.eval()
    exact = copy.deepcopy(module).double()
    sessions = [validation_session(graph) for graph, _ in graphs]
    names = [[o.name for o in session.get_outputs()] for session in sessions]
    returns_weights = ["attn_weights" in each for each in names]
    rng = np.random.default_rng(None if seed is None else [seed, 1])  # draws of their own, apart from the matrix's
    d = module.d_model
    results: list[list[ScaleResult]] = [[] for _ in graphs]
    tables = _Tables([report for _, report in graphs])
    for scale in INPUT_SCALES:
        # per graph: its output (abs, rel), its weights (abs, rel), eager output rel, eager weights rel
        worst = [np.zeros(6) for _ in graphs]
        largest = 0.0
        # per graph, the most weight any masked key got: exactly 0 at every scale, or the scale fails
        masked_weight = [0.0 for _ in graphs]
        for case in SCALE_CASES:
            query = scaled_inputs(rng, (case.batch, case.q_len, d), scale)
            key = value = query
            if case.kind == "cross":
                key, value = (scaled_inputs(rng, (case.batch, case.kv_len, d), scale) for _ in "kv")
            largest = max(largest, *(float(np.abs(a).max()) for a in (query, key, value)))
            eager_mask, onnx_mask = make_masks(case, rng)
            inputs = [torch.from_numpy(a) for a in (query, key, value)]
            mask = None if eager_mask is None else torch.from_numpy(eager_mask)
            with torch.no_grad():
                want = [t.numpy() for t in exact(*[t.double() for t in inputs], mask)]
                eager = [t.numpy() for t in module(*inputs, mask)]
            eager_errors = [max_errors(e, w)[1] for e, w in zip(eager, want, strict=True)]
            for number, session in enumerate(sessions):
                got = session.run(names[number], {"query": query, "key": key, "value": value, "mask": onnx_mask})
                if returns_weights[number] and eager_mask is not None:
                    weights = got[names[number].index("attn_weights")]
                    masked = weights[np.broadcast_to(~onnx_mask, weights.shape)]
                    most = max(masked_weight[number], float(masked.max(initial=0.0)))
                    masked_weight[number] = most if np.isfinite(masked).all() else float("nan")
                got_errors = [e for g, w in zip(got, want, strict=False) for e in max_errors(g, w)]
                got_errors += [0.0, 0.0] * (not returns_weights[number])
                worst[number] = np.maximum(worst[number], got_errors + eager_errors)
        for number in range(len(graphs)):
            result, line = _scale_verdict(scale, largest, worst[number], masked_weight[number],
                                          returns_weights[number], tolerance)  # fmt: skip
            results[number].append(result)
            tables.row(number, line)
    for number in range(len(graphs)):
        limit = input_limit(results[number])
        held = "at no scale" if limit is None else f"for inputs up to {limit:.4g} in magnitude"
        tables.end(
            number,
            f"input scales: {precision} holds {held} (against the exact answer: {tolerance}, or "
            f"{EAGER_ERROR_FACTOR} times eager float32's error)",
        )
    return results


def _scale_verdict(
    scale: float, largest: float, worst, masked_weight: float, weights_returned: bool, tolerance
) -> tuple[ScaleResult, str]:
    """One graph's verdict at one scale, from its worst errors there (output abs and rel, weights abs and rel,
    eager float32's output and weights rel) and the most weight a masked key got; and its table row."""
    out_abs, out_rel, attn_abs, attn_rel, eager_out, eager_attn = (float(v) for v in worst)
    passed = bool(  # NaN fails
        masked_weight == 0.0
        and (tolerance.output.allows(out_abs, out_rel) or out_rel <= EAGER_ERROR_FACTOR * eager_out)
        and (tolerance.weights.allows(attn_abs, attn_rel) or attn_rel <= EAGER_ERROR_FACTOR * eager_attn)
    )
    result = ScaleResult(
        scale,
        largest,
        out_rel,
        attn_rel if weights_returned else None,
        eager_out,
        eager_attn,
        passed,
        attn_abs if weights_returned else None,
    )
    attn_text = f"attn abs {attn_abs:8.1e} rel {attn_rel:8.1e}" if weights_returned else "attn (not returned)"
    if masked_weight != 0.0:
        attn_text += f", a masked key's weight {masked_weight:.1e}"
    line = (
        f"[scale {scale:>7g}] inputs up to {largest:9.3g}: output rel {out_rel:8.1e}  {attn_text}"
        f"  (eager float32 rel: {eager_out:8.1e}, {eager_attn:8.1e})  {'pass' if passed else 'FAIL'}"
    )
    return result, line


def export_holds(results: list[CaseResult], scales: list[ScaleResult]) -> bool:
    """An export is valid when no case of the matrix failed and it holds at unit scale and below."""
    return not any(r.failed for r in results) and input_limit(scales) is not None


def worst_failure(results: list[CaseResult], scales: list[ScaleResult], precision: str) -> str | None:
    """One line naming where an export that does not hold is furthest past its tolerance: the case of the matrix
    with the largest error over its bound, or else the first input scale at or below 1 that failed."""
    tolerance = TOLERANCES[precision]

    def excess(result: CaseResult) -> float:
        if result.error is not None:
            return float("inf")
        pairs = [(tolerance.output, result.output_max_abs, result.output_max_rel)]
        if result.attn_max_abs is not None:
            pairs.append((tolerance.weights, result.attn_max_abs, result.attn_max_rel))
        over = [bound.judged(max_abs, max_rel) / bound.limit for bound, max_abs, max_rel in pairs]
        return float("inf") if any(np.isnan(over)) else max(over)

    failed = [r for r in results if r.failed]
    if failed:
        worst = max(failed, key=excess)
        c = worst.case
        where = f"{c.kind}-attention B={c.batch} Lq={c.q_len} Lk={c.kv_len} mask={c.mask}"
        if worst.error is not None:
            return f"worst case: {where}: {worst.error}"
        attn = "" if worst.attn_max_abs is None else f", weights abs {worst.attn_max_abs:.2e}"
        return (
            f"worst case: {where}: output rel {worst.output_max_rel:.2e}{attn} ({excess(worst):.1f} times its "
            f"bound; {precision} tolerance: {tolerance})"
        )
    if input_limit(scales) is None:
        scale = next(r for r in sorted(scales, key=lambda r: r.scale) if not r.passed)
        attn = "" if scale.attn_max_abs is None else f", weights abs {scale.attn_max_abs:.2e}"
        return (
            f"worst case: inputs at scale {scale.scale:g}: output rel {scale.output_max_rel:.2e}{attn} "
            f"({precision} tolerance: {SCALE_TOLERANCES[precision]})"
        )
    return None


def input_limit(results: list[ScaleResult]) -> float | None:
    """The largest input magnitude up to which every scale held; None if a scale at or below 1 failed."""
    limit = None
    for result in sorted(results, key=lambda r: r.scale):
        if not result.passed:
            return None if result.scale <= 1.0 else limit
        limit = result.max_abs_input
    return limit


def validate(
    reference: MultiHeadAttention | ServedModuleReference | UserModuleReference,
    onnx_model: bytes | str,
    cases: Iterable[ValidationCase] | None = None,
    seed: int | None = None,
    report: Callable[[str], None] | None = None,
    precision: str = "fp32",
) -> list[CaseResult]:
    """Run every case against ONNX Runtime's CPU provider; ``report`` gets one table row per case.

    ``reference`` is the eager side, in float32 whatever ``precision`` the export computes in: the served
    module itself, or a reference wrapping a user's module.
    """
    return validate_graphs(reference, [(onnx_model, report or report_to_stderr)], cases, seed, precision)[0]


def validate_graphs(
    reference: MultiHeadAttention | ServedModuleReference | UserModuleReference,
    graphs: list[tuple[bytes | str, Callable[[str], None]]],
    cases: Iterable[ValidationCase] | None = None,
    seed: int | None = None,
    precision: str = "fp32",
) -> list[list[CaseResult]]:
    """``validate`` for graphs that answer the same requests (a folder's full graph and its output-only graph),
    each given with its report: every case drawn, and its reference answer computed, once for all of them. The
    first graph's table is reported as it runs, each other's after it. The results, a list per graph."""
    tolerance = TOLERANCES[precision]
    if isinstance(reference, MultiHeadAttention):
        reference = ServedModuleReference(reference)
    sessions = [validation_session(graph) for graph, _ in graphs]
    d_model = sessions[0].get_inputs()[0].shape[-1]
    cases = list(validation_cases() if cases is None else cases)
    rng = np.random.default_rng(seed)
    results: list[list[CaseResult]] = [[] for _ in graphs]
    tables = _Tables([report for _, report in graphs])
    for index, case in enumerate(cases, start=1):
        if case.kind == "cross" and reference.self_attention_only:
            nan = float("nan")
            judged = [CaseResult(case, nan, nan, None, None, SKIPPED, "the reference takes self-attention only")]
            judged *= len(graphs)
        else:
            inputs = case_inputs(case, rng, d_model)
            want = reference(inputs)
            judged = [judge_case(session, case, inputs, want, tolerance) for session in sessions]
        for number, result in enumerate(judged):
            results[number].append(result)
            tables.row(number, format_row(index, len(cases), result))
    for number in range(len(graphs)):
        counts = status_counts(results[number])
        tables.end(
            number,
            f"validation: {counts[PASS]} passed, {counts[FAIL]} failed, {counts[UNDEFINED]} undefined by the "
            f"reference, {counts[SKIPPED]} skipped (tolerance, {precision}: {tolerance})",
        )
    return results
