"""The summaries graph's search for each row's top key (export/summaries.py): by blocks of keys where a width divides
the keys, one by one otherwise; either way the first key of the largest score, as numpy's argmax, ties and rows of
-inf (keys masked out) included."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto
from onnx import helper as make

from mhaserve.export.summaries import BLOCK_WIDTHS, top_key_and_score


def top_key_search() -> ort.InferenceSession:
    """The nodes alone, over scores [B, h, Lq, Lk] given as the graph's input."""
    graph = make.make_graph(
        top_key_and_score("scores", "key", "score"),
        "top_key_search",
        [make.make_tensor_value_info("scores", TensorProto.FLOAT, ["B", "h", "Lq", "Lk"])],
        [
            make.make_tensor_value_info("key", TensorProto.INT64, None),
            make.make_tensor_value_info("score", TensorProto.FLOAT, None),
        ],
    )
    model = make.make_model(graph, opset_imports=[make.make_opsetid("", 18)], ir_version=9)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def block_width(keys: int) -> int | None:
    """The width the graph searches ``keys`` by: the first of BLOCK_WIDTHS to divide them in two blocks or more."""
    return next((width for width in BLOCK_WIDTHS if keys % width == 0 and keys >= 2 * width), None)


@pytest.mark.parametrize("keys", [512, 480, 500, 96, 48, 509, 40, 7, 1])
def test_the_top_key_is_the_first_key_of_the_largest_score(keys):
    """By blocks of 32, 40, 50, 32 and 24 keys, then one by one (a prime number of keys, and lengths too short for
    two blocks of 24)."""
    width = block_width(keys) or keys
    rng = np.random.default_rng(keys)
    scores = rng.standard_normal((2, 3, 9, keys)).astype(np.float32)
    scores[0, 0, 0] = 1.0  # every key ties
    scores[0, 0, 1] = -np.inf  # every key masked out
    if keys > 6:
        scores[0, 1, 2, [2, 5]] = 9.0  # a tie within the first block
    if width < keys:
        scores[0, 1, 3, [width + 3, 4]] = 9.0  # a tie across blocks: the first block's key wins
        scores[1, 2, 4, [width + 1, keys - 1]] = 9.0  # one past the first block, and in the last
    key, score = top_key_search().run(None, {"scores": scores})
    assert key.shape == score.shape == (2, 3, 9, 1) and key.dtype == np.int64
    np.testing.assert_array_equal(key[..., 0], scores.argmax(axis=-1))
    np.testing.assert_array_equal(score[..., 0], scores.max(axis=-1))


def test_the_widths_searched_by_are_those_measured_fastest():
    assert [block_width(keys) for keys in (512, 480, 500, 96, 48, 509, 40)] == [32, 40, 50, 32, 24, None, None]
