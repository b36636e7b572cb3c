"""A model folder is served only as exported: its graphs tied to its manifest by sha256, written whole or not
at all, and a damaged folder refused with one clear line and exit code 3 (a damaged default cache is rebuilt).
A folder exported before the output-only graph existed serves as it did."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest

from mhaserve.client.grpc import Client
from mhaserve.export.writer import export_model_dir
from mhaserve.server.process import free_port
from tests.support import SMALL_D_MODEL, eager, rand
from tests.support.in_process import refused_start


def copy_of(folder, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def edit_manifest(folder, change):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps(change(manifest)))


def refusal(folder) -> str:
    """The server's log when it refuses to serve ``folder``: a start that fails as exit code 3 would (the code and
    the one line of a process are test_server.py's)."""
    failure, log = refused_start(folder, "--warmup-runs", "0")
    assert failure.exit_code == 3, log
    assert "cannot serve" in log and "Traceback" not in log and "Event loop" not in log
    return log


def test_a_weight_changed_after_export_is_refused(small_model_dir, tmp_path):
    folder = copy_of(small_model_dir, tmp_path)
    model = onnx.load(str(folder / "model.onnx"))
    bias = next(t for t in model.graph.initializer if len(t.dims) == 1)
    array = onnx.numpy_helper.to_array(bias) + 1.0  # answers off by 1.0, and the manifest still says valid
    bias.CopyFrom(onnx.numpy_helper.from_array(array, bias.name))
    onnx.save(model, str(folder / "model.onnx"))
    assert "differs from the manifest's" in refusal(folder)


def test_a_changed_output_only_graph_is_refused(small_model_dir, tmp_path):
    folder = copy_of(small_model_dir, tmp_path)
    data = bytearray((folder / "model_output_only.onnx").read_bytes())
    data[-8:] = b"\x00" * 8
    (folder / "model_output_only.onnx").write_bytes(bytes(data))
    log = refusal(folder)
    assert "model_output_only.onnx: sha256" in log and "differs from the manifest's" in log


def without_output_only_graph(folder):
    """The folder as mhaserve wrote it before the output-only graph existed."""
    (folder / "model_output_only.onnx").unlink()

    def older(manifest):
        manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("output_only")}
        del manifest["validation"]["output_only"]
        return manifest

    edit_manifest(folder, older)
    return folder


def test_a_folder_without_an_output_only_graph_still_serves(start_server, small_model_dir, small_module, tmp_path):
    folder = without_output_only_graph(copy_of(small_model_dir, tmp_path))
    server = start_server(folder, "--warmup-runs", "0")
    assert "output_only_graph=no" in server.log
    query, key = rand(2, 5, SMALL_D_MODEL, seed=3), rand(2, 7, SMALL_D_MODEL, seed=4)
    want_out, want_attn = eager(small_module, query, key, key)
    with Client(server.url) as client:
        alone = client.infer(query, key, key, attn_weights=False)
        both = client.infer(query, key, key)
    np.testing.assert_allclose(alone.output, want_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(both.attn_weights, want_attn, rtol=0, atol=1e-5)


def test_served_answers_without_weights_equal_eager(start_server, small_model_dir, small_module):
    # From 256 keys the output-only graph answers: another kernel, the same answer within the export's tolerance.
    server = start_server(small_model_dir, "--max-q-len", "300", "--max-kv-len", "300", "--warmup-runs", "1")
    assert "output_only_graph=yes" in server.log
    query = rand(2, 300, SMALL_D_MODEL, seed=21)
    padding = np.ones((2, 300), dtype=bool)
    padding[1, 200:] = False
    causal = np.tril(np.ones((300, 300), dtype=bool))[None]
    with Client(server.url) as client:
        for mask in (None, padding, causal):
            result = client.infer(query, mask=mask, attn_weights=False)
            want_out, _ = eager(small_module, query, None, None, mask)
            assert result.attn_weights is None
            np.testing.assert_allclose(result.output, want_out, rtol=0, atol=1e-5)


def test_the_output_only_graph_can_be_turned_off(start_server, small_model_dir):
    server = start_server(small_model_dir, "--warmup-runs", "0", "--output-only-graph", "false")
    assert "output_only_graph=no" in server.log


def test_a_cut_short_model_file_is_refused(small_model_dir, tmp_path):
    folder = copy_of(small_model_dir, tmp_path)
    data = (folder / "model.onnx").read_bytes()
    (folder / "model.onnx").write_bytes(data[: len(data) // 2])
    assert "differs from the manifest's" in refusal(folder)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda m: [m], "holds a JSON array, expected an object"),
        (lambda m: {k: v for k, v in m.items() if k != "config"}, "'config' is None"),
        (lambda m: m | {"config": m["config"] | {"d_model": "64"}}, "config 'd_model' is '64'"),
        (lambda m: m | {"config": m["config"] | {"d_model": 10**30}}, "expected an integer from 1 to 65536"),
        (lambda m: m | {"config": m["config"] | {"num_heads": 5}}, "not divisible by num_heads 5"),
        (lambda m: m | {"files": {"model": "model.onnx"}}, "records no sha256"),
    ],
    ids=["not an object", "no config", "d_model a string", "d_model 10^30", "heads", "no sha256"],
)
def test_a_damaged_manifest_is_refused_with_one_line(small_model_dir, tmp_path, damage, expected):
    folder = copy_of(small_model_dir, tmp_path)
    edit_manifest(folder, damage)
    assert expected in refusal(folder)


def test_a_file_onnx_runtime_cannot_load_is_refused(small_model_dir, tmp_path):
    from mhaserve.contract.model_dir import file_sha256

    folder = copy_of(small_model_dir, tmp_path)
    (folder / "model.onnx").write_bytes(b"\x08\x07not a graph" * 100)
    edit_manifest(folder, lambda m: m | {"files": m["files"] | {"model_sha256": file_sha256(folder / "model.onnx")}})
    assert "ONNX Runtime cannot load it" in refusal(folder)


def test_a_failed_re_export_leaves_the_valid_folder_as_it_was(small_module, small_model_dir, tmp_path, monkeypatch):
    import mhaserve.export.writer as model_dir

    folder = copy_of(small_model_dir, tmp_path, "mha")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def disk_full(module, path):
        path.write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_dir, "save_weights", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_model_dir(small_module, folder, validation_seed=0, report=lambda _: None)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["mha"]  # no staging folder left behind


def test_a_damaged_default_cache_is_rebuilt_on_start(small_model_dir, tmp_path):
    # The default `mhaserve serve` found a truncated model.onnx beside a valid manifest and failed every start.
    cache = tmp_path / "cache"
    folder = cache / "models" / "mha-d512-h8-seed0"
    shutil.copytree(small_model_dir, folder)
    data = (folder / "model.onnx").read_bytes()
    (folder / "model.onnx").write_bytes(data[:100])
    port = free_port()
    env = {**os.environ, "MHASERVE_CACHE": str(cache), "MHASERVE_PORT": str(port), "MHASERVE_METRICS_PORT": "0",
           "MHASERVE_HTTP_PORT": "0"}  # fmt: skip
    process = subprocess.Popen(
        [sys.executable, "-m", "mhaserve.cli", "serve", "--warmup-runs", "0"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        log = []
        for line in process.stderr:
            log.append(line)
            if "serving model=" in line:
                break
        text = "".join(log)
        assert "differs from the manifest's" in text and "exporting the default model" in text, text
        assert len(log) <= 25, text  # the export's validation table went to the folder, not the terminal
        assert "serving model=mha version=1 d_model=512" in text
        assert json.loads((folder / "manifest.json").read_text())["valid"] is True
    finally:
        process.terminate()
        process.wait(30)


@pytest.fixture
def default_cache(small_model_dir, tmp_path, monkeypatch):
    """A default-model cache holding a copy of the small export, and the export commands a start would run (none
    is run): (folder, exports)."""
    import mhaserve.export.default_model as default_model

    monkeypatch.setenv("MHASERVE_CACHE", str(tmp_path / "cache"))
    folder = default_model.default_model_dir()
    shutil.copytree(small_model_dir, folder)
    exports = []

    def export(command):
        exports.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(default_model.subprocess, "run", export)
    return folder, exports


def test_a_default_cache_without_the_output_only_graph_is_exported_again(default_cache, capsys):
    from mhaserve.export.default_model import ensure_default_model

    folder, exports = default_cache
    assert ensure_default_model() == folder and exports == []  # up to date: used as it is
    without_output_only_graph(folder)
    ensure_default_model()
    assert exports and exports[0][-3:] == ["export", "--out", str(folder)]
    assert "an older export, without the output-only graph" in capsys.readouterr().err


# Exports from before a current graph: a step graph before a step's new rows were written in place, a summaries
# graph before it weighted the values by the softmax's output directly; their validation does not say so.
OLDER_GRAPHS = {
    "step_cache": (("step", "cache"), "whose step graph returns a sequence's whole cache at every step"),
    "summaries_weights": (("summaries", "graph"), "whose summaries graph makes the weights whole"),
}


@pytest.mark.parametrize("older", OLDER_GRAPHS.values(), ids=OLDER_GRAPHS.keys())
def test_a_default_cache_of_an_older_graph_is_exported_again(default_cache, capsys, older):
    from mhaserve.export.default_model import ensure_default_model

    (graph, key), why = older
    folder, exports = default_cache
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["validation"][graph][key]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    ensure_default_model()
    assert exports and why in capsys.readouterr().err


def test_export_keep_current_keeps_a_folder_of_the_same_weights_and_exports_anything_else(
    small_model_dir, tmp_path, monkeypatch, capsys
):
    import mhaserve.export.writer as writer
    from mhaserve.cli import main as cli
    from tests.support import SMALL_HEADS

    folder = copy_of(small_model_dir, tmp_path)  # the small module: seed 1
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    exported = []

    def export(module, out, **options):  # the export itself is tested elsewhere: here, whether it runs
        exported.append(options["source"])
        return {"valid": True, "validation": {"worst_failure": None}, "export_seconds": 0.0}

    monkeypatch.setattr(writer, "export_model_dir", export)

    def run(*extra: str) -> str:
        sizes = ["--d-model", str(SMALL_D_MODEL), "--heads", str(SMALL_HEADS)]
        assert cli(["export", "--out", str(folder), *sizes, "--keep-current", *extra]) == 0
        return capsys.readouterr().err

    assert "valid and intact: kept" in run("--seed", "1", "--triton-repo", str(tmp_path / "triton")) and exported == []
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert (tmp_path / "triton" / "mha" / "1" / "model.onnx").read_bytes() == before["model.onnx"]
    assert "it holds source {'kind': 'seed', 'seed': 1}, not {'kind': 'seed', 'seed': 2}" in run("--seed", "2")
    assert "it holds precision 'fp32', not 'fp16'" in run("--seed", "1", "--precision", "fp16")
    (folder / "model.onnx").write_bytes(before["model.onnx"][:100])
    assert "differs from the manifest's" in run("--seed", "1")
    assert exported == [{"kind": "seed", "seed": 2}, {"kind": "seed", "seed": 1}, {"kind": "seed", "seed": 1}]
    assert cli(["export", "--repository", str(tmp_path / "repo"), "--keep-current"]) == 2
    assert "--repository always writes a new version" in capsys.readouterr().err
