"""Prove an ONNX export computes what the eager module computes, case by case over a shape matrix.

Each case draws fresh random inputs, runs eager PyTorch (float32) and ONNX Runtime (CPU) and
compares both outputs. The eager side gets the mask in the rank the user would pass (key padding
[B, Lk], causal [1, Lq, Lk], full [B, Lq, Lk]); the ONNX side gets the served rank-4 form.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import numpy as np
import onnxruntime as ort
import torch

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


@dataclass
class CaseResult:
    case: ValidationCase
    output_max_abs: float
    output_max_rel: float
    attn_max_abs: float
    attn_max_rel: float
    passed: bool
    error: str | None = None

    def as_dict(self) -> dict:
        row = asdict(self.case) | {"kind": self.case.kind}
        row.update({k: v for k, v in asdict(self).items() if k != "case"})
        return row


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


def _errors(got: np.ndarray, want: np.ndarray) -> tuple[float, float]:
    # NaN anywhere propagates into the max and fails the case.
    max_abs = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    scale = float(np.max(np.abs(want))) or 1.0
    return max_abs, max_abs / scale


def run_case(
    module: MultiHeadAttention, session: ort.InferenceSession, case: ValidationCase, rng: np.random.Generator
) -> CaseResult:
    d = module.d_model
    query = rng.standard_normal((case.batch, case.q_len, d), dtype=np.float32)
    if case.kind == "self":
        key = value = query
    else:
        key = rng.standard_normal((case.batch, case.kv_len, d), dtype=np.float32)
        value = rng.standard_normal((case.batch, case.kv_len, d), dtype=np.float32)
    eager_mask, onnx_mask = make_masks(case, rng)

    with torch.no_grad():
        want_out, want_attn = module(
            torch.from_numpy(query),
            torch.from_numpy(key),
            torch.from_numpy(value),
            None if eager_mask is None else torch.from_numpy(eager_mask),
        )
    nan = float("nan")
    try:
        got_out, got_attn = session.run(
            ["output", "attn_weights"], {"query": query, "key": key, "value": value, "mask": onnx_mask}
        )
    except Exception as exc:  # an export that cannot run this shape fails the case, not the run
        return CaseResult(case, nan, nan, nan, nan, passed=False, error=str(exc).splitlines()[0][:300])
    if got_out.shape != tuple(want_out.shape) or got_attn.shape != tuple(want_attn.shape):
        expected = (tuple(want_out.shape), tuple(want_attn.shape))
        error = f"shapes {got_out.shape}, {got_attn.shape}; expected {expected[0]}, {expected[1]}"
        return CaseResult(case, nan, nan, nan, nan, passed=False, error=error)
    out_abs, out_rel = _errors(got_out, want_out.numpy())
    attn_abs, attn_rel = _errors(got_attn, want_attn.numpy())
    passed = out_abs <= TOLERANCE and attn_abs <= TOLERANCE
    return CaseResult(case, out_abs, out_rel, attn_abs, attn_rel, passed)


def format_row(index: int, total: int, result: CaseResult) -> str:
    c = result.case
    return (
        f"[{index:>3}/{total}] {c.kind:<5} B={c.batch:<2} Lq={c.q_len:<4} Lk={c.kv_len:<4} mask={c.mask:<11} "
        f"output abs {result.output_max_abs:8.1e} rel {result.output_max_rel:8.1e}  "
        f"attn abs {result.attn_max_abs:8.1e} rel {result.attn_max_rel:8.1e}  "
        f"{'pass' if result.passed else 'FAIL'}" + (f"  ({result.error})" if result.error else "")
    )


def validate(
    module: MultiHeadAttention,
    onnx_model: bytes | str,
    cases: Iterable[ValidationCase] | None = None,
    seed: int | None = None,
    report: Callable[[str], None] | None = None,
) -> list[CaseResult]:
    """Run every case against ONNX Runtime's CPU provider; ``report`` gets one table row per case."""
    report = report or (lambda line: print(line, file=sys.stderr, flush=True))
    module = module.eval()
    session = ort.InferenceSession(onnx_model, providers=["CPUExecutionProvider"])
    cases = list(validation_cases() if cases is None else cases)
    rng = np.random.default_rng(seed)
    results = []
    for index, case in enumerate(cases, start=1):
        result = run_case(module, session, case, rng)
        results.append(result)
        report(format_row(index, len(cases), result))
    failed = sum(not r.passed for r in results)
    passed = len(results) - failed
    report(f"validation: {passed} passed, {failed} failed (tolerance: max abs error <= {TOLERANCE:g})")
    return results
