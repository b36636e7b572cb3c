"""Attention weights shaped per request, in process: top-k and top-p against a sort-everything reference with
crafted ties and fully masked rows, selections equal to slices of the full weights, and every bad parameter
refused with a message naming it."""

from __future__ import annotations

import numpy as np
import pytest

from mhaserve.server.errors import ErrorKind, RequestError
from mhaserve.server.parameters import NO_SHAPING, weights_shaping
from mhaserve.server.shaping import mean_over_heads, shaped_weights, top_k, top_p

TOP_K = ("attn_weights_top_k_values", "attn_weights_top_k_indices")


def reference_order(row: np.ndarray) -> np.ndarray:
    """Positions by weight, highest first, ties by the lower position: the stated order, by brute force."""
    return np.array(sorted(range(len(row)), key=lambda i: (-float(row[i]), i)))


def weights_with_ties(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Few distinct values: most rows have ties, many of them across the k-th place.
    weights = rng.integers(0, 4, size=(2, 3, 5, 9)).astype(np.float32) / 8
    weights[0, 1, 2] = 0.0  # a fully masked row: zeros
    weights[1, 0, 0] = 0.25  # every key tied
    return weights


@pytest.mark.parametrize("k", [1, 2, 4, 8, 9])
def test_top_k_is_the_reference_order_ties_by_lower_position(k):
    weights = weights_with_ties()
    values, indices = top_k(weights, k)
    assert values.shape == indices.shape == (2, 3, 5, k) and indices.dtype == np.int64
    for index in np.ndindex(weights.shape[:-1]):
        expected = reference_order(weights[index])[:k]
        np.testing.assert_array_equal(indices[index], expected)
        np.testing.assert_array_equal(values[index], weights[index][expected])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 1.0])
def test_top_p_takes_the_fewest_keys_holding_p_of_the_mass(p):
    rng = np.random.default_rng(1)
    weights = rng.random((2, 2, 4, 7)).astype(np.float32)
    weights[..., 3] = weights[..., 1]  # ties
    weights /= weights.sum(axis=-1, keepdims=True)
    weights[1, 1, 2] = 0.0  # fully masked
    values, indices = top_p(weights, p)
    k = values.shape[-1]
    counts = []
    for index in np.ndindex(weights.shape[:-1]):
        row = weights[index]
        order = reference_order(row)
        if row.sum() == 0:
            count = 0
        else:
            running = np.cumsum(row[order].astype(np.float64))
            count = int(np.argmax(running >= p * running[-1])) + 1
        counts.append(count)
        np.testing.assert_array_equal(indices[index][:count], order[:count])
        np.testing.assert_array_equal(values[index][:count], row[order[:count]])
        assert (indices[index][count:] == -1).all() and (values[index][count:] == 0).all()
    assert k == max(counts)


def test_no_shaping_returns_views_of_the_run_and_the_mean_over_heads():
    weights = weights_with_ties()
    answer = shaped_weights(weights, ("attn_weights", "attn_weights_mean"), NO_SHAPING)
    assert answer["attn_weights"] is weights
    np.testing.assert_array_equal(answer["attn_weights_mean"], weights.mean(axis=1))


def test_heads_rows_and_keys_are_slices_of_the_full_weights_and_top_k_indices_count_from_the_start():
    weights = weights_with_ties()
    parameters = {"attn_heads": "2,0", "attn_rows": "1:4", "attn_keys": "-6:", "attn_weights_precision": "FP16"}
    shaping, outputs = weights_shaping(parameters, ("attn_weights", "attn_weights_mean"), 3, 5, 9)
    assert outputs is None
    answer = shaped_weights(weights, ("attn_weights", "attn_weights_mean"), shaping)
    chosen = weights[:, [2, 0], 1:4, 3:9]
    np.testing.assert_array_equal(answer["attn_weights"], chosen.astype(np.float16))
    np.testing.assert_array_equal(answer["attn_weights_mean"], chosen.mean(axis=1).astype(np.float16))
    shaping, outputs = weights_shaping({"attn_keys": "3:9", "attn_top_k": "2"}, (), 3, 5, 9)
    assert outputs == ("output", "attn_weights_top_k_values", "attn_weights_top_k_indices")
    answer = shaped_weights(weights, outputs, shaping)
    for index in np.ndindex(weights.shape[:-1]):
        expected = 3 + reference_order(weights[index][3:9])[:2]
        np.testing.assert_array_equal(answer["attn_weights_top_k_indices"][index], expected)


def test_integers_and_their_string_forms_are_both_accepted():
    as_text, _ = weights_shaping({"attn_top_k": "3", "attn_heads": "1"}, (), 4, 8, 8)
    as_numbers, _ = weights_shaping({"attn_top_k": 3, "attn_heads": 1}, (), 4, 8, 8)
    assert as_text == as_numbers and as_text.top_k == 3 and as_text.heads == (1,)
    assert weights_shaping({"attn_top_p": "0.5"}, (), 4, 8, 8)[0].top_p == 0.5


@pytest.mark.parametrize(
    ("parameters", "named", "words"),
    [
        ({"attn_heads": "0,x"}, (), ["attn_heads", "0,3", "'0,x'"]),
        ({"attn_heads": "4"}, (), ["attn_heads", "head 4", "0..3"]),
        ({"attn_heads": "1,1"}, (), ["attn_heads", "more than once"]),
        ({"attn_rows": "5:2"}, (), ["attn_rows", "'5:2'", "8 query rows"]),
        ({"attn_rows": "0:9"}, (), ["attn_rows", "'0:9'"]),
        ({"attn_keys": "1:2:3"}, (), ["attn_keys", "start:stop"]),
        ({"attn_top_k": "0"}, (), ["attn_top_k", "1..8"]),
        ({"attn_top_k": 9}, (), ["attn_top_k", "1..8"]),
        ({"attn_keys": "0:4", "attn_top_k": 5}, (), ["attn_top_k", "1..4"]),
        ({"attn_top_k": "two"}, (), ["attn_top_k", "integer", "'two'"]),
        ({"attn_top_p": 0}, (), ["attn_top_p", "(0, 1]"]),
        ({"attn_top_p": "1.5"}, (), ["attn_top_p", "(0, 1]", "1.5"]),
        ({"attn_top_k": 2, "attn_top_p": 0.5}, (), ["attn_top_k", "attn_top_p", "both"]),
        ({"attn_weights_precision": "FP64"}, (), ["attn_weights_precision", "FP32 or FP16", "FP64"]),
        ({"attn_head": "0"}, (), ["unknown parameter 'attn_head'", "attn_heads"]),
        ({"attn_heads": "0"}, ("output",), ["attn_heads", "none of the weights' outputs", "output"]),
        ({"attn_top_k": 2}, ("attn_weights",), ["attn_top_k", "attn_weights_top_k_values"]),
    ],
)
def test_a_bad_option_is_refused_naming_the_parameter_what_it_allows_and_what_came(parameters, named, words):
    with pytest.raises(RequestError) as refused:
        weights_shaping(parameters, named, 4, 8, 8)
    assert refused.value.kind == ErrorKind.INVALID_ARGUMENT
    for word in words:
        assert word in refused.value.message, (word, refused.value.message)


def test_other_parameters_are_left_alone():
    assert weights_shaping({"priority": 1, "binary_data_output": True}, (), 4, 8, 8) == (NO_SHAPING, None)


def test_the_serialised_kernels_are_the_graphs_onnx_builds():
    from mhaserve.server import kernels

    built = kernels.build_graphs()
    assert built == {name: getattr(kernels, name) for name in ("TOP_K_GRAPH", "TO_FLOAT16_GRAPH", "APPEND_GRAPH")}
    weights = np.random.default_rng(3).random((4, 33)).astype(np.float32)
    np.testing.assert_array_equal(kernels.to_float16(weights), weights.astype(np.float16))


def test_top_k_outputs_asked_for_without_a_ranking_come_back_empty():
    weights = weights_with_ties()
    for parameters in ({}, {"attn_heads": "0,1"}):
        shaping, outputs = weights_shaping(parameters, ("output", *TOP_K), 3, 5, 9)
        answer = shaped_weights(weights, TOP_K, shaping)
        heads = 2 if parameters else 3
        assert answer[TOP_K[0]].shape == answer[TOP_K[1]].shape == (2, heads, 5, 0)
        assert answer[TOP_K[1]].dtype == np.int64


@pytest.mark.parametrize("heads", [8, 12])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_the_mean_over_heads_is_numpys_mean_bit_for_bit(heads, dtype):
    weights = np.random.default_rng(heads).random((2, heads, 9, 13)).astype(dtype)
    for view in (weights, weights[:, ::2], weights[:, :, 2:7, 1:]):  # selections of heads, rows and keys too
        got, want = mean_over_heads(view), view.mean(axis=1)
        assert got.dtype == want.dtype and np.array_equal(got, want)


def test_ranking_is_counted_in_the_budget_at_its_worst():
    from mhaserve.server.parameters import WeightsShaping
    from mhaserve.server.shaping import TOP_P_BYTES_PER_KEY, ranking_bytes

    # Top-p at a flat row ranks every key of the selection; top-k its k.
    assert ranking_bytes(WeightsShaping(top_p=0.9), 1, 8, 512, 512) == TOP_P_BYTES_PER_KEY * 8 * 512 * 512
    assert ranking_bytes(WeightsShaping(heads=(0,), keys=(0, 128), top_p=1.0), 2, 8, 64, 512) == (
        TOP_P_BYTES_PER_KEY * 2 * 1 * 64 * 128
    )
    assert ranking_bytes(WeightsShaping(top_k=4), 1, 8, 16, 16) == 12 * 8 * 16 * 4
    assert ranking_bytes(WeightsShaping(heads=(1, 2)), 1, 8, 16, 16) == 0
