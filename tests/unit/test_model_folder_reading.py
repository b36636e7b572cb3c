"""A model folder as the server reads it, in process: its checks made once for every runtime (ModelFolder), and the
full graphs the batched runtime runs (AttentionGraphs): the output-only graph for runs that fetch the output alone
over many keys, and, in one of --workers, graphs of every core's threads for a run made alone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnxruntime as ort
import pytest

from mhaserve.contract.model_dir import ModelDirError
from mhaserve.server.graphs import OUTPUT_ONLY_FROM_KV_LEN, AttentionGraphs
from mhaserve.server.model_folder import ModelFolder
from tests.support import SMALL_D_MODEL, SMALL_HEADS, rand


def edited_copy(folder, tmp_path, change):
    """A copy of ``folder`` whose manifest ``change`` edited."""
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    path = target / "manifest.json"
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    return target


def test_a_folder_is_read_once_with_its_graph_checked_and_its_model_described(small_model_dir):
    folder = ModelFolder.read(small_model_dir, "cpu")
    assert folder.graph_path == small_model_dir / "model.onnx" and folder.device == "cpu"
    assert folder.output_only_path() == small_model_dir / "model_output_only.onnx"
    assert folder.step_path("step") == small_model_dir / "model_step.onnx"
    info = AttentionGraphs(folder, intra_op_threads=1).info
    assert (info.d_model, info.num_heads, info.precision, info.computed_in) == (SMALL_D_MODEL, SMALL_HEADS, "fp32",
                                                                              "float32")  # fmt: skip
    assert info.max_abs_input is None and info.mask_exact_input_limit > 0


def test_a_folder_whose_export_failed_validation_is_refused_naming_the_command_that_checks_it(
    small_model_dir, tmp_path
):
    folder = edited_copy(small_model_dir, tmp_path, lambda manifest: manifest | {"valid": False})
    with pytest.raises(ModelDirError, match=r"failed validation .*'mhaserve validate .*copy'"):
        ModelFolder.read(folder)


def test_a_device_other_than_auto_cpu_or_cuda_is_refused(small_model_dir):
    with pytest.raises(ValueError, match="device must be auto, cpu or cuda, got 'tpu'"):
        ModelFolder.read(small_model_dir, "tpu")


def test_graph_metadata_without_the_models_width_is_refused_naming_the_file(small_model_dir):
    folder = ModelFolder.read(small_model_dir, "cpu")
    with pytest.raises(ModelDirError, match=r"model.onnx: metadata_props lacks 'mhaserve.d_model'"):
        folder.info({"mhaserve.num_heads": "2"})


def test_short_runs_keep_the_full_graph(small_model_dir):
    # Below OUTPUT_ONLY_FROM_KV_LEN keys the output-only graph measured no faster.
    query = rand(2, OUTPUT_ONLY_FROM_KV_LEN - 1, SMALL_D_MODEL, seed=8)
    mask = np.ones((1, 1, 1, query.shape[1]), dtype=bool)
    session = AttentionGraphs.open(small_model_dir, "cpu", intra_op_threads=1)
    (alone,) = session.run(("output",), query, query, query, mask)
    with_weights, _ = session.run(("output", "attn_weights"), query, query, query, mask)
    assert np.array_equal(alone, with_weights)


def test_runs_without_weights_take_the_output_only_graph(small_model_dir):
    query = rand(2, OUTPUT_ONLY_FROM_KV_LEN, SMALL_D_MODEL, seed=8)
    mask = np.ones((1, 1, 1, query.shape[1]), dtype=bool)
    feeds = {"query": query, "key": query, "value": query, "mask": mask}
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    direct = {
        name: ort.InferenceSession(str(small_model_dir / name), options, providers=["CPUExecutionProvider"])
        for name in ("model.onnx", "model_output_only.onnx")
    }
    session = AttentionGraphs.open(small_model_dir, "cpu", intra_op_threads=1)
    assert session.has_output_only_graph
    (alone,) = session.run(("output",), query, query, query, mask)
    with_weights, _ = session.run(("output", "attn_weights"), query, query, query, mask)
    # Bit for bit each graph's own answer (the fused kernel rounds differently from the traced graph).
    assert np.array_equal(alone, direct["model_output_only.onnx"].run(["output"], feeds)[0])
    assert np.array_equal(with_weights, direct["model.onnx"].run(["output"], feeds)[0])
    assert not np.array_equal(alone, with_weights)
    np.testing.assert_allclose(alone, with_weights, rtol=0, atol=1e-6)
    turned_off = AttentionGraphs.open(small_model_dir, "cpu", intra_op_threads=1, output_only=False)
    assert not turned_off.has_output_only_graph
    assert np.array_equal(turned_off.run(("output",), query, query, query, mask)[0], with_weights)


def test_a_run_alone_takes_the_graphs_of_every_cores_threads_and_answers_alike(small_model_dir):
    quiet = [True]
    session = AttentionGraphs.open(small_model_dir, "cpu", intra_op_threads=1, alone_threads=2, alone=lambda: quiet[0])
    assert session.alone_threads == 2
    query = rand(1, 300, SMALL_D_MODEL, seed=4)  # from 256 keys the output alone takes the output-only graph
    mask = np.ones((1, 1, 1, query.shape[1]), dtype=bool)
    answers = {}
    for quiet[0] in (True, False):
        for outputs in (("output",), ("output", "attn_weights")):
            graph = session.graph_for(outputs, query.shape[1])
            threads = graph.get_session_options().intra_op_num_threads
            assert threads == (2 if quiet[0] else 1), (quiet[0], outputs)
            answers[quiet[0], outputs] = session.run(outputs, query, query, query, mask)[0]
    for outputs in (("output",), ("output", "attn_weights")):
        np.testing.assert_allclose(answers[True, outputs], answers[False, outputs], rtol=0, atol=1e-6)
    one_set = AttentionGraphs.open(small_model_dir, "cpu", intra_op_threads=2, alone_threads=2, alone=lambda: True)
    assert one_set.alone_threads == 0  # no more threads to take: no second set of graphs
