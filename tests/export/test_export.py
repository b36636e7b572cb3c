"""The ONNX export: the folder it writes, the graph's signature, and each torch 2.13 exporter trap.

Every trap test runs the exported graph in ONNX Runtime at the shape that the trap would break.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from mhaserve.cli import main as cli
from mhaserve.export.onnx_export import check_onnx, export_onnx
from mhaserve.export.validate import (
    ServedModuleReference,
    ValidationCase,
    validate,
    validation_cases,
    validation_session,
)
from mhaserve.export.writer import export_model_dir, revalidate_model_dir
from mhaserve.model import load_weights, save_weights
from mhaserve.server.config import ServerSettings
from mhaserve.server.model_config import model_settings
from tests.support import SMALL_D_MODEL, SMALL_HEADS, eager, rand

D = SMALL_D_MODEL


@pytest.fixture(scope="module")
def session(small_model_dir):
    return ort.InferenceSession(str(small_model_dir / "model.onnx"), providers=["CPUExecutionProvider"])


def infer(session, query, key=None, value=None, mask=None):
    key = query if key is None else key
    value = key if value is None else value
    if mask is None:
        mask = np.ones((1, 1, 1, key.shape[1]), dtype=bool)
    return session.run(None, {"query": query, "key": key, "value": value, "mask": mask})


def assert_same(got, want, atol=1e-5):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)


def test_folder_holds_the_graphs_weights_manifest_and_validation_table(small_model_dir):
    # torch.export's ONNX program is saved with external data; our folder holds one file per graph unless huge.
    assert sorted(p.name for p in small_model_dir.iterdir()) == [
        "manifest.json",
        "model.onnx",
        "model_cross_step.onnx",
        "model_grouped_cross_steps.onnx",
        "model_grouped_steps.onnx",
        "model_output_only.onnx",
        "model_step.onnx",
        "model_summaries.onnx",
        "validation.txt",
        "weights.pt",
    ]
    graphs = (
        "model.onnx",
        "model_output_only.onnx",
        "model_step.onnx",
        "model_cross_step.onnx",
        "model_grouped_cross_steps.onnx",
        "model_grouped_steps.onnx",
    )
    for name in graphs:
        model = onnx.load(str(small_model_dir / name), load_external_data=False)
        assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def test_output_only_graph_is_validated_and_recorded(small_model_dir):
    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    assert manifest["files"]["output_only"] == "model_output_only.onnx"
    assert len(manifest["files"]["output_only_sha256"]) == 64
    checked = manifest["validation"]["output_only"]
    assert checked["passed"] is True
    assert checked["counts"] == {"pass": len(validation_cases()), "fail": 0, "undefined": 0, "skipped": 0}
    assert all(c["attn_max_abs"] is None for c in checked["cases"])  # it returns no weights
    assert max(c["output_max_abs"] for c in checked["cases"]) <= 1e-5
    scales = checked["input_scales"]["scales"]
    assert scales and all(s["passed"] and s["attn_max_rel"] is None for s in scales)
    assert checked["input_scales"]["max_abs_input"] == max(s["max_abs_input"] for s in scales)
    graph = onnx.load(str(small_model_dir / "model_output_only.onnx"))
    assert [o.name for o in graph.graph.output] == ["output"]
    assert {p.key: p.value for p in graph.metadata_props}["mhaserve.d_model"] == str(D)


@pytest.mark.parametrize("mask_kind", ["every key", "key padding", "causal with a fully masked row"])
def test_output_only_graph_answers_as_the_eager_module(small_model_dir, small_module, mask_kind):
    # Every key allowed takes the fused kernel's FlashAttention path; any mask, the fused kernel with a bias.
    graph = ort.InferenceSession(str(small_model_dir / "model_output_only.onnx"), providers=["CPUExecutionProvider"])
    query, key = rand(3, 9, D, seed=5), rand(3, 11, D, seed=6)
    mask = np.ones((1, 1, 1, 11), dtype=bool)
    if mask_kind == "key padding":
        mask = np.ones((3, 1, 1, 11), dtype=bool)
        mask[1, ..., 7:] = False
    elif mask_kind.startswith("causal"):
        mask = np.tril(np.ones((9, 11), dtype=bool), k=2)[None, None].copy()
        mask[0, 0, 4] = False
    (got,) = graph.run(["output"], {"query": query, "key": key, "value": key, "mask": mask})
    want, _ = eager(small_module, query, key, key, mask)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    if mask_kind.startswith("causal"):
        assert not got[:, 4].any()  # a row with every key masked answers zeros


def test_a_failing_output_only_graph_marks_the_folder_not_valid(small_module, tmp_path, monkeypatch):
    import mhaserve.export.writer as model_dir
    from mhaserve.export.output_only import output_only_graph

    def off_by_a_bias(module):
        graph = output_only_graph(module)
        bias = next(t for t in graph.graph.initializer if t.name == "W_o.bias")
        bias.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(bias) + 0.01, bias.name))
        return graph

    monkeypatch.setattr(model_dir, "output_only_graph", off_by_a_bias)
    manifest = export_model_dir(small_module, tmp_path / "mha", validation_seed=0, report=lambda _: None)
    assert manifest["validation"]["cases"] and all(c["passed"] for c in manifest["validation"]["cases"])
    assert manifest["validation"]["output_only"]["passed"] is False
    assert manifest["validation"]["output_only"]["counts"]["fail"] > 0
    assert manifest["valid"] is False and manifest["validation"]["passed"] is False


def test_the_full_and_output_only_graphs_are_validated_in_one_pass_each_case_answered_once(small_module, tmp_path):
    # Both graphs answer the same requests: each case is drawn, and the reference answers it, once for both;
    # each graph's table stays whole, the output-only graph's after the full graph's.
    answered = []

    class CountingReference(ServedModuleReference):
        def __call__(self, inputs):
            answered.append(inputs.query.shape)
            return super().__call__(inputs)

    rows = []
    reference = CountingReference(small_module)
    folder = tmp_path / "mha"
    manifest = export_model_dir(small_module, folder, validation_seed=0, report=rows.append, reference=reference)
    cases = len(validation_cases())
    assert manifest["valid"] and len(answered) == cases
    assert manifest["validation"]["counts"]["pass"] == manifest["validation"]["output_only"]["counts"]["pass"] == cases
    full_table_ends = rows.index(next(r for r in rows if r.startswith("validation: ")))
    only_rows = [i for i, r in enumerate(rows) if re.match(r"output-only graph: \[ *\d+/", r)]  # its cases' rows
    assert len(only_rows) == cases and min(only_rows) > full_table_ends


def test_validation_sessions_do_not_spin_between_runs(small_model_dir):
    # The eager reference computes between a graph's runs: spinning threads would hold the cores it needs.
    session = validation_session(str(small_model_dir / "model.onnx"))
    assert session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_manifest_describes_the_model(small_model_dir):
    manifest = json.loads((small_model_dir / "manifest.json").read_text())
    assert manifest["valid"] is True
    assert manifest["config"] == {"d_model": D, "num_heads": SMALL_HEADS, "d_k": D // SMALL_HEADS}
    assert manifest["source"] == {"kind": "seed", "seed": 1}
    assert manifest["exporter"] == "torch.onnx (torch.export, dynamo=True)"
    assert manifest["inputs"] == [
        {"name": "query", "dtype": "float32", "shape": ["batch", "q_len", D]},
        {"name": "key", "dtype": "float32", "shape": ["batch", "kv_len", D]},
        {"name": "value", "dtype": "float32", "shape": ["batch", "kv_len", D]},
        {"name": "mask", "dtype": "bool", "shape": ["mask_batch", 1, "mask_q_len", "kv_len"]},
    ]
    assert manifest["outputs"] == [
        {"name": "output", "dtype": "float32", "shape": ["batch", "q_len", D]},
        {"name": "attn_weights", "dtype": "float32", "shape": ["batch", SMALL_HEADS, "q_len", "kv_len"]},
    ]
    assert manifest["opset"] == 18
    assert set(manifest["versions"]) == {"mhaserve", "torch", "onnx", "onnxruntime"}
    assert manifest["versions"]["torch"].startswith("2.13.0")
    cases = manifest["validation"]["cases"]
    assert len(cases) == len(validation_cases()) and all(c["passed"] for c in cases)
    assert max(c["output_max_abs"] for c in cases) <= 1e-5


def test_onnx_metadata_describes_the_model_alone(small_model_dir):
    model = onnx.load(str(small_model_dir / "model.onnx"))
    props = {p.key: p.value for p in model.metadata_props}
    assert props["mhaserve.d_model"] == str(D)
    assert props["mhaserve.num_heads"] == str(SMALL_HEADS)
    assert props["mhaserve.opset"] == "18"
    assert props["mhaserve.valid"] == "True"
    assert props["mhaserve.name"] == "mha"
    # and ONNX Runtime exposes them to a server that never loads onnx or torch
    meta = ort.InferenceSession(str(small_model_dir / "model.onnx")).get_modelmeta().custom_metadata_map
    assert meta["mhaserve.d_model"] == str(D)


def test_checker_and_shape_inference_pass(small_model_dir):
    check_onnx(onnx.load(str(small_model_dir / "model.onnx")))


def test_graph_computes_no_shapes_at_run_time(small_model_dir):
    # Each node costs ONNX Runtime microseconds whatever its size, and traced reshapes computed B and L with
    # 27 of the graph's 61 nodes. Heads split and merge by Reshapes to constant shapes whose 0s keep B and L.
    graph = onnx.load(str(small_model_dir / "model.onnx")).graph
    ops = [node.op_type for node in graph.node]
    assert not {"Shape", "Gather", "Concat", "Slice", "Unsqueeze"} & set(ops), sorted(ops)
    constants = {out for node in graph.node if node.op_type == "Constant" for out in node.output}
    constants |= {tensor.name for tensor in graph.initializer}
    reshapes = [node for node in graph.node if node.op_type == "Reshape"]
    assert len(reshapes) == 4 and all(node.input[1] in constants for node in reshapes)


def test_trap_size_one_dims_are_not_baked_in(session, small_module):
    # Batch 1 and length 1 run, and the declared dims stay symbolic.
    for b, lq, lk in [(1, 1, 1), (1, 1, 9), (1, 9, 1), (4, 1, 1), (3, 17, 2)]:
        q, kv = rand(b, lq, D, seed=b), rand(b, lk, D, seed=lk)
        assert_same(infer(session, q, kv), eager(small_module, q, kv))
    for value in session.get_inputs()[:3]:
        assert all(isinstance(dim, str) for dim in value.shape[:2]), value


def test_trap_key_is_its_own_input_not_tied_to_query(session, small_model_dir, small_module):
    # Exporting mha(x, x, x) would tie Lk to Lq and never read `key`.
    model = onnx.load(str(small_model_dir / "model.onnx"))
    consumed = {name for node in model.graph.node for name in node.input}
    assert {"query", "key", "value", "mask"} <= consumed
    q, k, v = rand(2, 3, D, seed=1), rand(2, 8, D, seed=2), rand(2, 8, D, seed=3)
    got = infer(session, q, k, v)
    assert got[1].shape == (2, SMALL_HEADS, 3, 8)
    assert_same(got, eager(small_module, q, k, v))
    # a different key changes the answer
    assert not np.allclose(infer(session, q, rand(2, 8, D, seed=4), v)[0], got[0])


def test_trap_batch_size_comes_from_query_not_mask(session, small_module):
    # A mask of batch 1 (shared by every row of the batch) must not set the graph's batch size.
    q = rand(3, 5, D, seed=5)
    causal = np.tril(np.ones((5, 5), dtype=bool))[None]  # [1, Lq, Lk]
    got = infer(session, q, mask=causal[:, None])
    assert got[0].shape == (3, 5, D)
    assert_same(got, eager(small_module, q, q, q, causal))


def test_trap_key_padding_and_full_masks_both_accepted(session, small_module):
    # A graph declaring [B, 1, 1, Lk] would reject [B, 1, Lq, Lk], and the reverse.
    q, kv = rand(2, 4, D, seed=6), rand(2, 6, D, seed=7)
    padding = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], dtype=bool)
    assert_same(infer(session, q, kv, mask=padding[:, None, None, :]), eager(small_module, q, kv, kv, padding))
    full = np.random.default_rng(8).random((2, 4, 6)) < 0.6
    full[:, :, 0] = True
    assert_same(infer(session, q, kv, mask=full[:, None]), eager(small_module, q, kv, kv, full))


def test_fully_masked_row_is_zero_in_the_export_too(session, small_module):
    q = rand(1, 3, D, seed=9)
    allowed = np.ones((1, 3, 3), dtype=bool)
    allowed[0, 1] = False
    out, attn = infer(session, q, mask=allowed[:, None])
    assert np.all(out[0, 1] == 0) and np.all(attn[0, :, 1] == 0) and not np.isnan(out).any()
    assert_same((out, attn), eager(small_module, q, q, q, allowed))


def test_validation_catches_perturbed_weights(small_module):
    wrong = export_onnx(small_module)
    for tensor in wrong.graph.initializer:
        if tensor.dims == [D, D]:  # one projection matrix
            w = onnx.numpy_helper.to_array(tensor).copy()
            w[0, 0] += 1e-2
            tensor.CopyFrom(onnx.numpy_helper.from_array(w, tensor.name))
            break
    cases = [ValidationCase(2, 5, 5, "none"), ValidationCase(1, 1, 1, "causal")]
    results = validate(small_module, wrong.SerializeToString(), cases, seed=0, report=lambda _: None)
    assert not all(r.passed for r in results)


def test_validation_catches_a_static_shape_export(small_module, tmp_path):
    from mhaserve.export.onnx_export import INPUT_NAMES, OUTPUT_NAMES, _OnnxSignature, example_inputs, translations

    path = tmp_path / "static.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.export's own pytree deprecation
        program = torch.onnx.export(  # the same export without dynamic shapes
            _OnnxSignature(small_module),
            example_inputs(D),
            dynamo=True,
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            custom_translation_table=translations(),
            verbose=False,
        )
    program.save(str(path))
    results = validate(small_module, str(path), seed=0, report=lambda _: None)
    failed = [r for r in results if not r.passed]
    assert failed and all(r.error for r in failed)
    # only the example's own shapes could pass
    assert all((r.case.batch, r.case.q_len, r.case.kv_len) == (2, 5, 7) for r in results if r.passed)


def test_failed_validation_marks_the_folder_not_valid(small_module, tmp_path, monkeypatch):
    import mhaserve.export.writer as model_dir

    real_export = model_dir.export_onnx

    def export_with_wrong_bias(module, opset, precision):
        model = real_export(module, opset, precision)
        bias = next(t for t in model.graph.initializer if t.dims == [D])
        b = onnx.numpy_helper.to_array(bias) + 1.0
        bias.CopyFrom(onnx.numpy_helper.from_array(b, bias.name))
        return model

    monkeypatch.setattr(model_dir, "export_onnx", export_with_wrong_bias)
    manifest = export_model_dir(small_module, tmp_path / "bad", validation_seed=0, report=lambda _: None)
    assert manifest["valid"] is False and manifest["validation"]["passed"] is False
    assert not revalidate_model_dir(tmp_path / "bad", seed=0, report=lambda _: None)


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_cli_export_with_a_triton_repo_then_validate(tmp_path, capsys):
    out = tmp_path / "cli"
    done = run_cli("export", "--d-model", "32", "--heads", "2", "--seed", "4", "--out", str(out),
                   "--triton-repo", str(tmp_path / "repo"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "dims: 32" in (tmp_path / "repo" / "mha" / "config.pbtxt").read_text()
    # the folder's own configuration, where the server reads it: every setting commented out, the flags apply
    assert model_settings(ServerSettings(), out).configured == frozenset()
    assert "# max_batch_size: 32" in (out / "config.pbtxt").read_text() and str(out / "config.pbtxt") in done.stderr
    # On the terminal the summaries, every row in the folder (and on the terminal with --verbose).
    assert "68 passed, 0 failed" in done.stderr and "[ 68/68]" not in done.stderr
    assert len(done.stderr.strip().splitlines()) <= 12, done.stderr
    assert "[ 68/68]" in (out / "validation.txt").read_text() and str(out / "validation.txt") in done.stderr
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr
    assert json.loads((out / "manifest.json").read_text())["source"] == {"kind": "seed", "seed": 4}

    assert cli(["validate", "--model-dir", str(out), "--seed", "3"]) == 0  # the command's own main, in this process
    assert "68 passed, 0 failed" in capsys.readouterr().err


def test_cli_validate_fails_on_a_tampered_model(tmp_path, small_model_dir, capsys):
    import shutil

    folder = tmp_path / "tampered"
    shutil.copytree(small_model_dir, folder)
    model = onnx.load(str(folder / "model.onnx"))
    w = next(t for t in model.graph.initializer if t.dims == [D, D])
    arr = onnx.numpy_helper.to_array(w) * 1.01
    w.CopyFrom(onnx.numpy_helper.from_array(arr, w.name))
    onnx.save(model, str(folder / "model.onnx"))
    assert cli(["validate", str(folder), "--seed", "0"]) == 1  # the command's own main, in this process
    assert "FAIL" in capsys.readouterr().err


def test_cli_validate_inputs_refuses_what_the_server_would_and_a_folder_of_other_weights(
    tmp_path, small_model_dir, capsys
):
    def refused(arrays, *against) -> str:
        np.savez(tmp_path / "in.npz", **arrays)
        code = cli(["validate", str(small_model_dir), "--inputs", str(tmp_path / "in.npz"), *against])
        said = capsys.readouterr().err
        assert code == 2 and len(said.strip().splitlines()) == 1, said
        return said

    query = rand(1, 5, D, seed=1)
    assert f"input 'query': shape [5, {D}], expected rank 3" in refused({"query": query[0]})
    assert "input 'query': 5 non-finite values" in refused({"query": np.where(np.arange(D) == 0, np.nan, query)})
    assert "input 'mask': shape [1, 5, 9], expected [1, 5] (key padding) or [1, 5, 5]" in refused(
        {"query": query, "mask": np.ones((1, 5, 9), bool)}
    )
    other = tmp_path / "other"
    shutil.copytree(small_model_dir, other)
    module = load_weights(other / "weights.pt")
    with torch.no_grad():
        module.W_v.bias[0] += 0.5
    save_weights(module, other / "weights.pt")
    said = refused({"query": query}, "--against", str(other))
    assert f"holds other weights than {small_model_dir} (W_v.bias differs by up to 0.5)" in said
    manifest = json.loads((other / "manifest.json").read_text())
    (other / "manifest.json").write_text(json.dumps(manifest | {"precision": "fp16"}))
    assert "exported in fp16; give a float32 one" in refused({"query": query}, "--against", str(other))
    said = refused({"query": query}, "--against", "/nonexistent")
    assert "--against /nonexistent: no such folder; give a model folder 'mhaserve export' wrote" in said


def test_cli_rejects_bad_sizes(tmp_path, capsys):
    assert cli(["export", "--d-model", "100", "--heads", "3", "--out", str(tmp_path / "x")]) == 2
    stderr = capsys.readouterr().err
    assert "divisible by num_heads" in stderr and len(stderr.strip().splitlines()) == 1, stderr


def test_an_opset_below_the_exports_own_is_refused_not_exported_as_18_and_called_what_was_asked(
    tmp_path, capsys, small_module
):
    assert cli(["export", "--opset", "17", "--d-model", "16", "--heads", "2", "--out", str(tmp_path / "x")]) == 2
    stderr = capsys.readouterr().err.strip()
    assert stderr == "mhaserve export: error: --opset 17: the export is written for opset 18 and later"
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="opset 18 and later, got 17"):
        export_onnx(small_module, opset=17)


def test_triton_repo_describes_the_exported_model(small_model_dir, tmp_path):
    import onnxruntime as ort
    from google.protobuf import text_format

    from mhaserve.export.triton_repo import write_triton_repo
    from mhaserve.protos.generated import model_config_pb2 as mc

    target = write_triton_repo(small_model_dir, tmp_path / "repo", max_batch_size=16)
    assert target == tmp_path / "repo" / "mha"
    assert (target / "1" / "model.onnx").read_bytes() == (small_model_dir / "model.onnx").read_bytes()
    config = text_format.Parse((target / "config.pbtxt").read_text(), mc.ModelConfig())
    assert (config.name, config.platform, config.max_batch_size) == ("mha", "onnxruntime_onnx", 16)
    assert config.HasField("dynamic_batching")

    # Every graph input and output, in name and type, with the graph's dims less the batch dim.
    session = ort.InferenceSession(str(target / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    onnx_type = {"tensor(float)": mc.TYPE_FP32, "tensor(bool)": mc.TYPE_BOOL}

    def dims(shape):
        return [d if isinstance(d, int) else -1 for d in shape[1:]]

    graph = {t.name: (onnx_type[t.type], dims(t.shape)) for t in (*session.get_inputs(), *session.get_outputs())}
    described = {t.name: (t.data_type, list(t.dims)) for t in (*config.input, *config.output)}
    assert described == graph
    assert described["query"] == (mc.TYPE_FP32, [-1, SMALL_D_MODEL])
    assert described["attn_weights"] == (mc.TYPE_FP32, [SMALL_HEADS, -1, -1])
