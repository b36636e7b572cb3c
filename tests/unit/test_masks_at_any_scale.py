"""A masked key never takes a row's weight. Inputs can be crafted from a module's own weights so that an allowed
key's score overflows to -inf, or falls below the mask's finite bias, while a masked key's stays small: the masked
key then took the weight with every value finite. Each export records the input magnitude up to which no score can
reach that far (model.mha.mask_exact_input_limit), and the server refuses inputs past it; up to it, the same
crafted inputs leave every masked key exactly zero weight, in every graph."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest

from mhaserve.contract.steps import PAST_KEY, PAST_LENGTHS, PAST_VALUE
from mhaserve.model import SCORE_REACH_LIMIT, mask_exact_input_limit, seeded_module
from tests.support import eager
from tests.support.crafted import crafted_cross_attention, crafted_first_step


def scaled_to(limit: float, *arrays: np.ndarray) -> list[np.ndarray]:
    largest = max(float(np.abs(a).max()) for a in arrays)
    return [(a.astype(np.float64) * (limit / largest)).astype(np.float32) for a in arrays]


def test_the_crafted_inputs_give_a_masked_key_the_weight_in_eager_float32(small_module):
    query, key, mask = crafted_cross_attention(small_module)
    _, weights = eager(small_module, query, key, key, mask)
    assert np.isfinite(weights).all() and (weights[..., 1] > 0.5).all()  # what the server must never answer
    assert float(np.abs(np.concatenate([query, key], axis=1)).max()) > mask_exact_input_limit(small_module)


@pytest.mark.parametrize("d_model,heads", [(64, 4), (512, 8)])
def test_no_score_reaches_the_limit_for_inputs_up_to_the_recorded_magnitude(d_model, heads):
    module = seeded_module(d_model, heads, seed=2)
    limit = mask_exact_input_limit(module)
    w_q, w_k = (layer.weight.detach().double().numpy() for layer in (module.W_q, module.W_k))
    b_q, b_k = (layer.bias.detach().double().numpy() for layer in (module.W_q, module.W_k))
    # The worst input for each projection: every element at the limit, signed to add up along its largest row.
    x_q = limit * np.sign(w_q[np.abs(w_q).sum(axis=1).argmax()])
    x_k = limit * np.sign(w_k[np.abs(w_k).sum(axis=1).argmax()])
    q, k = w_q @ x_q + b_q, w_k @ x_k + b_k
    assert module.d_k * np.abs(q).max() * np.abs(k).max() < SCORE_REACH_LIMIT
    assert module.d_k * np.abs(q).max() * np.abs(k).max() > SCORE_REACH_LIMIT / 4  # and the bound is not loose


def test_the_export_records_the_limit(small_model_dir, small_module):
    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    assert manifest["mask_exact_input_limit"] == pytest.approx(mask_exact_input_limit(small_module))


@pytest.mark.parametrize("graph", ["model.onnx", "model_output_only.onnx"])
def test_up_to_the_limit_the_crafted_inputs_leave_masked_keys_no_weight(small_model_dir, small_module, graph):
    session = ort.InferenceSession(str(small_model_dir / graph), providers=["CPUExecutionProvider"])
    query, key, mask = crafted_cross_attention(small_module)
    query, key = scaled_to(mask_exact_input_limit(small_module), query, key)
    outputs = session.run(None, {"query": query, "key": key, "value": key, "mask": mask})
    want, want_weights = eager(small_module, query, key, key, mask)
    assert np.isfinite(outputs[0]).all()
    np.testing.assert_allclose(outputs[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert (want_weights[..., 1] == 0).all()
    if len(outputs) > 1:
        assert (outputs[1][..., 1] == 0).all()


def test_up_to_the_limit_a_step_gives_the_future_row_no_weight(small_model_dir, small_module):
    session = ort.InferenceSession(str(small_model_dir / "model_step.onnx"), providers=["CPUExecutionProvider"])
    (x,) = scaled_to(mask_exact_input_limit(small_module), crafted_first_step(small_module))
    empty = np.zeros((1, small_module.num_heads, 0, small_module.d_k), np.float32)
    feed = {"query": x, PAST_KEY: empty, PAST_VALUE: empty, PAST_LENGTHS: np.zeros(1, np.int64)}
    _, weights, _, _ = session.run(None, feed)
    assert np.isfinite(weights).all() and (weights[:, :, 0, 1] == 0).all()
