"""Unmodified Triton clients against mhaserve: tritonclient.grpc (sync and aio), each in its own process."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from tests.support import SMALL_D_MODEL, SMALL_HEADS, eager
from tests.support.triton import INPUTS, cases, run_triton_client

D = SMALL_D_MODEL


# Looked up, not imported: its protobuf messages would clash with mhaserve's in this process.
if importlib.util.find_spec("tritonclient") is None:
    pytest.skip("tritonclient is not installed (it comes with the test extra)", allow_module_level=True)


@pytest.mark.parametrize("mode", ["sync", "aio"])
def test_tritonclient_answers_equal_eager(server, small_module, tmp_path, mode):
    results = run_triton_client(server, tmp_path, mode)
    for case, arrays in cases().items():
        want_out, want_attn = eager(small_module, *(arrays.get(n) for n in INPUTS))
        np.testing.assert_allclose(results[f"{case}_output"], want_out, rtol=0, atol=1e-5)
        np.testing.assert_allclose(results[f"{case}_attn_weights"], want_attn, rtol=0, atol=1e-5)


def test_tritonclient_reads_metadata_config_and_statistics(server, tmp_path):
    results = run_triton_client(server, tmp_path, "sync")
    assert results["metadata_shapes"].tolist() == [-1, -1, D] * 3 + [-1, -1, -1]
    assert int(results["config_max_batch_size"]) == 0
    assert int(results["inference_count"]) >= 5
    assert results["cross_attn_weights"].shape == (2, SMALL_HEADS, 3, 5)


def test_tritonclient_asks_for_the_weights_averaged_over_heads(server, small_module, tmp_path):
    # As nn.MultiheadAttention returns by default: an output of its own, h times fewer bytes, no custom code.
    results = run_triton_client(server, tmp_path, "sync", outputs="output,attn_weights_mean")
    assert not any(name.endswith("_attn_weights") for name in results.files)
    for case, arrays in cases().items():
        _, want_attn = eager(small_module, *(arrays.get(n) for n in INPUTS))
        np.testing.assert_allclose(results[f"{case}_attn_weights_mean"], want_attn.mean(axis=1), rtol=0, atol=1e-6)
