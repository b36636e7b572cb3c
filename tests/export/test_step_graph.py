"""The step graph: a sequence fed in random steps of 1-8 rows, from an empty cache, answers each step's rows as
eager PyTorch's causal answer for the whole sequence does, alone and stepped together with sequences of other
lengths (their pasts side by side), its keys and values kept as the server keeps them (buffers with room, each step's
new rows written in place); the grouped step graph steps several sequences in one run, each over its own buffers,
each as eager answers it alone; an export records its validation in the manifest."""

from __future__ import annotations

import json

import pytest

from mhaserve.contract.model_dir import STEP_CACHE_IN_PLACE
from mhaserve.contract.steps import STEPS_GROUPED, STEPS_GROUPED_WIDE, steps_grouped
from mhaserve.export.step import (
    BATCHED_CASE,
    GROUPED_CASE,
    STEP_CASES,
    grouped_step_graph,
    step_graph,
    validate_grouped_cross_steps,
    validate_grouped_steps,
    validate_steps,
)
from mhaserve.model import seeded_module


@pytest.mark.parametrize("d_model,heads", [(512, 8), (768, 12)])
def test_steps_equal_the_causal_answer_for_the_whole_sequence(d_model, heads):
    module = seeded_module(d_model, heads, seed=3)
    results = validate_steps(module, step_graph(module).SerializeToString(), seed=11, report=lambda _: None)
    assert [r["status"] for r in results] == ["pass"] * (len(STEP_CASES) + 1)
    *alone, together = results
    for result, (batch, length) in zip(alone, STEP_CASES, strict=True):
        assert sum(result["steps"]) == length and max(result["steps"]) <= 8 and result["batch"] == batch
        assert result["output_max_abs"] < 1e-5 and result["weights_max_abs"] < 1e-5
    # Sequences of different lengths stepped as one batch, each against its own causal answer.
    assert together["batched"] == [list(case) for case in BATCHED_CASE]
    assert together["steps"] == min(length for _, length in BATCHED_CASE) - 1
    assert together["output_max_abs"] < 1e-5 and together["weights_max_abs"] < 1e-5


def test_a_step_graph_of_other_weights_fails_its_validation():
    module, other = seeded_module(64, 4, seed=1), seeded_module(64, 4, seed=2)
    rows = []
    results = validate_steps(module, step_graph(other).SerializeToString(), seed=0, report=rows.append)
    assert all(r["status"] == "FAIL" for r in results) and all(row.endswith("FAIL") for row in rows)


def test_the_export_writes_and_records_the_step_graph(small_model_dir):
    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    assert manifest["files"]["step"] == "model_step.onnx" and len(manifest["files"]["step_sha256"]) == 64
    step = manifest["validation"]["step"]
    assert step["passed"] and len(step["cases"]) == len(STEP_CASES) + 1 and step["cache"] == STEP_CACHE_IN_PLACE
    assert "step graph: [1/3]" in (small_model_dir / "validation.txt").read_text()
    assert "stepped together" in (small_model_dir / "validation.txt").read_text()


def test_validate_checks_the_step_graph_of_a_folder_again(small_model_dir, tmp_path):
    import shutil

    import onnx

    from mhaserve.export.writer import revalidate_model_dir

    folder = tmp_path / "copy"
    shutil.copytree(small_model_dir, folder)
    assert revalidate_model_dir(folder, seed=5, report=lambda _: None)
    onnx.save(step_graph(seeded_module(64, 4, seed=9)), str(folder / "model_step.onnx"))  # another module's steps
    rows = []
    assert not revalidate_model_dir(folder, seed=5, report=rows.append)
    assert any(row.startswith("step graph:") and row.endswith("FAIL") for row in rows)


@pytest.mark.parametrize("d_model,heads", [(512, 8), (768, 12)])
def test_the_grouped_graph_steps_each_sequence_as_eager_answers_it_alone(d_model, heads):
    module = seeded_module(d_model, heads, seed=4)
    graph = grouped_step_graph(module).SerializeToString()
    [result] = validate_grouped_steps(module, graph, seed=12, report=lambda _: None)
    assert result["status"] == "pass" and result["grouped"] == [list(case) for case in GROUPED_CASE]
    assert result["steps"] == min(length for _, length in GROUPED_CASE) - 1
    assert result["output_max_abs"] < 1e-5 and result["weights_max_abs"] < 1e-5


def test_the_grouped_cross_graph_steps_each_sequence_over_its_keys_as_eager_answers_it_alone():
    module = seeded_module(512, 8, seed=4)
    graph = grouped_step_graph(module, cross=True).SerializeToString()
    [result] = validate_grouped_cross_steps(module, graph, seed=12, report=lambda _: None)
    assert result["status"] == "pass" and result["output_max_abs"] < 1e-5 and result["weights_max_abs"] < 1e-5


@pytest.mark.parametrize("cross", [False, True])
def test_a_grouped_graph_of_other_weights_fails_its_validation(cross):
    module, other = seeded_module(64, 4, seed=1), seeded_module(64, 4, seed=2)
    validate = validate_grouped_cross_steps if cross else validate_grouped_steps
    rows = []
    [result] = validate(module, grouped_step_graph(other, cross=cross).SerializeToString(), seed=0, report=rows.append)
    assert result["status"] == "FAIL" and rows[-1].endswith("FAIL")


def test_the_export_writes_records_and_validates_again_the_grouped_graph(small_model_dir, tmp_path):
    import shutil

    import onnx

    from mhaserve.export.writer import revalidate_model_dir

    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    for kind, name in (
        ("grouped_step", "model_grouped_steps.onnx"),
        ("grouped_cross_step", "model_grouped_cross_steps.onnx"),
    ):
        assert manifest["files"][kind] == name and manifest["validation"][kind]["passed"]
        assert manifest["validation"][kind]["members"] == STEPS_GROUPED  # a narrow model: eight
    assert "grouped step graph:" in (small_model_dir / "validation.txt").read_text()
    assert "grouped cross step graph:" in (small_model_dir / "validation.txt").read_text()
    folder = tmp_path / "copy"
    shutil.copytree(small_model_dir, folder)
    onnx.save(grouped_step_graph(seeded_module(64, 4, seed=9)), str(folder / "model_grouped_steps.onnx"))
    rows = []
    assert not revalidate_model_dir(folder, seed=5, report=rows.append)
    assert any(row.startswith("grouped step graph:") and row.endswith("FAIL") for row in rows)


def test_wide_models_group_more_steps_a_run():
    assert steps_grouped(512) == steps_grouped(768) == STEPS_GROUPED
    assert steps_grouped(1024) == steps_grouped(4096) == STEPS_GROUPED_WIDE
