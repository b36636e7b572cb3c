"""The session's runs bound to a device: on CUDA the server copies each distinct input array up once (a
self-attention request is one array fed as query, key and value) and has ONNX Runtime write the outputs into host
arrays; here the same binding on the CPU's device, against ONNX Runtime's own run."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from mhaserve.contract.model_dir import output_only_file, read_manifest
from mhaserve.server.session import output_only_once_copied, run_bound
from tests.support import SMALL_D_MODEL, SMALL_HEADS, rand

D = SMALL_D_MODEL


@pytest.mark.parametrize("graph", ["model", "output_only"])
def test_a_run_bound_to_a_device_answers_as_a_plain_run_self_and_cross_attention_alike(small_model_dir, graph):
    path = small_model_dir / "model.onnx"
    if graph == "output_only":
        path = output_only_file(small_model_dir, read_manifest(small_model_dir))
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    outputs = ["output", "attn_weights"] if graph == "model" else ["output"]
    x, memory = rand(2, 5, D, seed=1), rand(2, 7, D, seed=2)
    for query, key, value in ((x, x, x), (x, memory, rand(2, 7, D, seed=3))):
        mask = np.ones((2, 1, 5, key.shape[1]), bool)
        mask[1, :, :, -2:] = False
        feed = {"query": query, "key": key, "value": value, "mask": mask}
        shapes = {"output": (2, 5, D), "attn_weights": (2, SMALL_HEADS, 5, key.shape[1])}
        bound = run_bound(session, outputs, feed, shapes, "cpu")
        for got, want in zip(bound, session.run(outputs, feed), strict=True):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(got, want)


def test_only_output_only_runs_that_repeat_a_large_input_are_bound():
    # Where it was measured faster on a GPU: the repeated copies saved outweigh binding's own cost.
    large, other = np.zeros((8, 512, 512), np.float32), np.zeros((8, 512, 512), np.float32)
    small = np.zeros((1, 16, 512), np.float32)
    assert output_only_once_copied(["output"], large, large, large)
    assert output_only_once_copied(["output"], small, large, large)  # cross-attention over one memory array
    assert not output_only_once_copied(["output", "attn_weights"], large, large, large)
    assert not output_only_once_copied(["output"], small, small, small)
    assert not output_only_once_copied(["output"], large, other, other.copy())
