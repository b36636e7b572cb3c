"""Unmodified Triton clients against mhaserve: tritonclient.grpc (sync and aio), in processes of their own as a user's
programs would run them, and tritonclient beside mhaserve.client in one process."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support import SMALL_D_MODEL, SMALL_HEADS, eager
from tests.support.triton import INPUTS, cases, run_triton_client

D = SMALL_D_MODEL


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


@pytest.mark.parametrize("order", ["triton-first", "mhaserve-first"])
def test_tritonclient_and_mhaserve_client_work_in_one_process(server, small_module, order):
    # Both define grpc_service.proto and model_config.proto; mhaserve's are kept in a descriptor pool of their own.
    script = Path(__file__).parents[1] / "support" / "clients" / "both_clients.py"
    http = server.http_url.removeprefix("http://")
    done = subprocess.run([sys.executable, str(script), order, server.url, http, str(D)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    answers = json.loads(done.stdout)
    query = np.random.default_rng(0).standard_normal((1, 3, D), dtype=np.float32)
    want, _ = eager(small_module, query)
    assert sorted(answers) == ["mhaserve-grpc", "mhaserve-http", "triton-grpc", "triton-http"]
    for name, output in answers.items():
        np.testing.assert_allclose(np.array(output, np.float32), want, rtol=0, atol=1e-5, err_msg=name)
