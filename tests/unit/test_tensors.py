"""Decoded inputs checked against the model and the limits before anything runs: shapes, lengths, limits named
where they were set, non-finite values, ranges past which an answer would not be exact, and masks' forms."""

from __future__ import annotations

import numpy as np
import pytest

from mhaserve.contract.signature import ModelSignature
from mhaserve.server.errors import ErrorKind, RequestError
from mhaserve.server.tensors import Limits, array_from_bytes, array_from_values, checked_inputs, element_count

D = 8
MODEL = ModelSignature(name="mha", version="1", d_model=D, num_heads=2)
LIMITS = Limits(max_batch_size=4, max_q_len=16, max_kv_len=32)


def request(model=MODEL, limits=LIMITS, **arrays):
    return checked_inputs(arrays, (), model, limits)


def refused(kind=ErrorKind.INVALID_ARGUMENT, **arrays) -> str:
    with pytest.raises(RequestError) as error:
        request(**arrays)
    assert error.value.kind is kind
    return error.value.message


def x(batch, length, width=D, scale=1.0):
    return (np.random.default_rng(0).standard_normal((batch, length, width)) * scale).astype(np.float32)


def test_self_attention_uses_the_query_as_key_and_value_and_masks_nothing():
    query = x(2, 5)
    built = request(query=query)
    assert built.key is query and built.value is query
    assert built.mask.shape[-1] == 5 and built.mask.all()


def test_key_padding_and_per_query_masks_take_the_served_rank_four_form():
    query, key = x(2, 3), x(2, 6)
    padding = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=bool)
    assert request(query=query, key=key, mask=padding).mask.shape == (2, 1, 1, 6)
    per_query = np.ones((2, 3, 6), dtype=bool)
    assert request(query=query, key=key, mask=per_query).mask.shape == (2, 1, 3, 6)


def test_shapes_that_do_not_fit_the_model_are_refused_naming_the_tensor_and_what_was_expected():
    assert "last dim 7, expected d_model 8" in refused(query=x(1, 3, width=7))
    assert "expected rank 3" in refused(query=np.zeros((3, D), np.float32))
    assert "batch 1, expected 2 (the batch of 'query')" in refused(query=x(2, 3), key=x(1, 3))
    assert "length 4, expected 3 (the length of 'key')" in refused(query=x(1, 2), key=x(1, 3), value=x(1, 4))
    assert "'value' is given without 'key'" in refused(query=x(1, 2), value=x(1, 2))
    assert "'query' is missing" in refused(key=x(1, 2))


def test_limits_are_refused_as_exhausted_naming_the_flag_or_the_model_s_file_that_set_them():
    message = refused(ErrorKind.RESOURCE_EXHAUSTED, query=x(5, 2))
    assert "batch 5 exceeds the limit max_batch_size=4 (the server's --max-batch-size raises it)" in message
    configured = Limits(4, 16, 32, set_by="/models/mha/config.pbtxt", configured=("max_q_len",))
    with pytest.raises(RequestError) as error:
        request(limits=configured, query=x(1, 17))
    assert "q_len 17 exceeds the limit max_q_len=16 (set by /models/mha/config.pbtxt)" in error.value.message


def test_non_finite_and_out_of_range_inputs_are_refused_before_they_run():
    query = x(1, 3)
    query[0, 1, 2] = np.nan
    assert "1 non-finite values" in refused(query=query)
    bounded = ModelSignature(name="mha", version="1", d_model=D, num_heads=2, mask_exact_input_limit=100.0)
    with pytest.raises(RequestError) as error:
        request(model=bounded, query=x(1, 3), key=x(1, 3, scale=1e4))
    assert "input 'key'" in error.value.message and "a masked key could take the weight" in error.value.message
    request(model=bounded, query=x(1, 3), key=x(1, 3), value=x(1, 3, scale=1e4))  # values make no scores


def test_tensors_from_the_wire_must_hold_what_their_shape_and_datatype_say():
    raw = np.arange(6, dtype=np.float32).tobytes()
    assert array_from_bytes("query", "FP32", [1, 2, 3], raw).shape == (1, 2, 3)
    with pytest.raises(RequestError, match=r"20 bytes of raw contents, expected 24 \(FP32 \[1, 2, 3\]\)"):
        array_from_bytes("query", "FP32", [1, 2, 3], raw[:20])
    with pytest.raises(RequestError, match=r"value 300 in contents is out of range for UINT8 \[0, 255\]"):
        array_from_values("mask", "UINT8", [1, 2], [1, 300], "contents")
    with pytest.raises(RequestError, match="holds no elements"):
        element_count("query", [0, 2**63 - 1, 8])
    with pytest.raises(RequestError, match="negative dimension"):
        element_count("query", [1, -2, 8])
