"""Live parity's bounds: the tolerance the export states for its precision, and no tighter than TF32's where the
version's float32 products run in TF32 (the CUDA provider with --cuda-tf32), whose answers float32's bound would
count as breaches."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from mhaserve.export.validate import TOLERANCES
from mhaserve.server.parity import TF32_BOUND, Bound, bounds_of


def manifest(precision: str) -> dict:
    return {"validation": {"tolerance": asdict(TOLERANCES[precision])}}


def test_a_float32_export_is_held_to_its_1e_5_and_in_tf32_to_float16_s_bound():
    assert bounds_of(manifest("fp32")) == {"output": Bound(1e-5, relative=True),
                                           "attn_weights": Bound(1e-5, relative=False)}  # fmt: skip
    assert bounds_of(manifest("fp32"), tf32=True) == {"output": TF32_BOUND, "attn_weights": TF32_BOUND}
    assert TF32_BOUND == Bound(TOLERANCES["fp16"].output.max_rel, relative=True)  # one figure, the export's


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_bounds_as_loose_as_tf32_s_or_looser_stay_as_stated(precision):
    assert bounds_of(manifest(precision), tf32=True) == bounds_of(manifest(precision))
