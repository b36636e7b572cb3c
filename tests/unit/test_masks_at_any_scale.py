"""A masked key never takes a row's weight, whatever the scores: inputs crafted so that an allowed key's score
overflows to -inf while a masked key's stays finite (the mask's bias is finite, so such a masked key would win the
softmax with every value finite) are answered NaN by every graph, which the server refuses, never answered; the
eager module agrees. At the scales export validation tries, masked keys get exactly zero weight."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from mhaserve.contract.steps import PAST_LENGTHS
from mhaserve.export.step import PAST_KEY, PAST_VALUE, step_graph
from tests.support import eager, rand
from tests.support.crafted import crafted_cross_attention, crafted_first_step


def test_eager_answers_nan_where_a_masked_key_would_win(small_module):
    query, key, mask = crafted_cross_attention(small_module)
    output, _ = eager(small_module, query, key, key, mask)
    assert not np.isfinite(output).any()


@pytest.mark.parametrize("graph", ["model.onnx", "model_output_only.onnx"])
def test_every_graph_answers_nan_where_a_masked_key_would_win(small_model_dir, small_module, graph):
    session = ort.InferenceSession(str(small_model_dir / graph), providers=["CPUExecutionProvider"])
    query, key, mask = crafted_cross_attention(small_module)
    output = session.run(None, {"query": query, "key": key, "value": key, "mask": mask})[0]
    assert not np.isfinite(output).any()
    # The same graph answers a request of ordinary scale beside it: only the crafted batch row is refused.
    normal = rand(1, 1, small_module.d_model, seed=1), rand(1, 2, small_module.d_model, seed=2)
    both = {"query": np.concatenate([query, normal[0]]), "key": np.concatenate([key, normal[1]]),
            "value": np.concatenate([key, normal[1]]), "mask": np.concatenate([mask, mask])}  # fmt: skip
    output = session.run(None, both)[0]
    assert not np.isfinite(output[0]).any() and np.isfinite(output[1]).all()


def test_the_step_graph_answers_nan_where_a_future_row_would_win(small_module):
    session = ort.InferenceSession(step_graph(small_module).SerializeToString(), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, small_module.num_heads, 0, small_module.d_k), np.float32)
    feed = {"query": crafted_first_step(small_module), PAST_KEY: empty, PAST_VALUE: empty,
            PAST_LENGTHS: np.zeros(1, np.int64)}  # fmt: skip
    output, weights, _, _ = session.run(None, feed)
    assert not np.isfinite(output[0, 0]).any()


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_masked_keys_get_exactly_zero_weight(small_model_dir, small_module, scale):
    session = ort.InferenceSession(str(small_model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    query, key = rand(2, 5, small_module.d_model, seed=5) * scale, rand(2, 7, small_module.d_model, seed=6) * scale
    mask = np.random.default_rng(7).random((2, 1, 5, 7)) < 0.5
    mask[..., 0] = True
    _, weights = session.run(None, {"query": query, "key": key, "value": key, "mask": mask})
    assert np.isfinite(weights).all()
    assert (weights[np.broadcast_to(~mask, weights.shape)] == 0).all()
