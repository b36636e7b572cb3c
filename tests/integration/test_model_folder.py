"""A model folder is served only as exported: model.onnx tied to its manifest by sha256, written whole or not
at all, and a damaged folder refused with one clear line and exit code 3 (a damaged default cache is rebuilt)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import onnx
import pytest

from mhaserve.export.model_dir import export_model_dir
from mhaserve.testing.server_process import ServerProcess, free_port


def copy_of(folder, tmp_path, name="copy"):
    target = tmp_path / name
    shutil.copytree(folder, target)
    return target


def edit_manifest(folder, change):
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps(change(manifest)))


def refusal(folder) -> str:
    process = ServerProcess(folder, "--warmup-runs", "0").start(wait=False)
    code = process.wait_exit(60)
    assert code == 3, process.log
    assert "cannot serve" in process.log and "Traceback" not in process.log and "Event loop" not in process.log
    return process.log


def test_a_weight_changed_after_export_is_refused(small_model_dir, tmp_path):
    folder = copy_of(small_model_dir, tmp_path)
    model = onnx.load(str(folder / "model.onnx"))
    bias = next(t for t in model.graph.initializer if len(t.dims) == 1)
    array = onnx.numpy_helper.to_array(bias) + 1.0  # answers off by 1.0, and the manifest still says valid
    bias.CopyFrom(onnx.numpy_helper.from_array(array, bias.name))
    onnx.save(model, str(folder / "model.onnx"))
    assert "differs from the manifest's" in refusal(folder)


def test_a_cut_short_model_file_is_refused(small_model_dir, tmp_path):
    folder = copy_of(small_model_dir, tmp_path)
    data = (folder / "model.onnx").read_bytes()
    (folder / "model.onnx").write_bytes(data[: len(data) // 2])
    assert "differs from the manifest's" in refusal(folder)


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (lambda m: [m], "holds a JSON list, expected an object"),
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
    import mhaserve.export.model_dir as model_dir

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
        assert "serving model=mha version=1 d_model=512" in text
        assert json.loads((folder / "manifest.json").read_text())["valid"] is True
    finally:
        process.terminate()
        process.wait(30)
