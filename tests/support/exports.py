"""Exports the tests serve rather than test, made once and kept in pytest's cache folder (.pytest_cache) for as
long as what decides their content is the same: the code that writes a folder (the model, the exporter, the
folder's contract), the libraries it runs on, the module's weights and the export's options. The test workers of
a run share them, and so do the two phases of the README's test command and a developer's next run; a change to
any of those makes a new export. Tests copy a folder before changing anything in it."""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import json
import re
import shutil
from importlib import metadata
from pathlib import Path

# What an export's files depend on besides the module and the options.
WRITER_PACKAGES = ("mhaserve.model", "mhaserve.export", "mhaserve.contract")
LIBRARIES = ("torch", "onnx", "onnxscript", "onnxruntime-gpu", "onnxruntime", "numpy")


def _writer_digest():
    digest = hashlib.sha256()
    for package in WRITER_PACKAGES:
        folder = Path(importlib.import_module(package).__file__).parent
        for source in sorted(folder.rglob("*.py")):
            digest.update(str(source.relative_to(folder)).encode())
            digest.update(source.read_bytes())
    for library in LIBRARIES:
        try:
            digest.update(f"{library}=={metadata.version(library)}".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{library} absent".encode())
    return digest


class ExportCache:
    def __init__(self, root: Path):
        self.root = root
        self._writer = _writer_digest()

    def folder(self, name: str, module, **options) -> Path:
        """A validated export of ``module`` with ``export_model_dir``'s ``options`` (validation seed 0 unless
        given), exported by the first worker to ask and shared by the others: ``<cache>/<name>-<key>/mha``."""
        from mhaserve.contract.model_dir import why_not_current
        from mhaserve.export.writer import export_model_dir

        options = {"validation_seed": 0, **options}
        digest = self._writer.copy()
        digest.update(type(module).__qualname__.encode() + repr(sorted(options.items())).encode())
        for key, tensor in sorted(module.state_dict().items()):
            digest.update(key.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
        entry = self.root / f"{name}-{digest.hexdigest()[:16]}"
        out = entry / "mha"
        with open(self.root / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            # Kept only while valid and intact, as the server checks a folder: a test that changed it by mistake
            # costs the next run an export, not a wrong folder.
            if why_not_current(out) is not None:
                for stale in self.root.iterdir():  # this name's: made by other code or weights, or damaged
                    if re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{16}}", stale.name):
                        shutil.rmtree(stale)
                manifest = export_model_dir(module, out, report=lambda _: None, **options)
                assert manifest["valid"], f"the {name} export failed validation: {manifest['validation']}"
        return out


def drifted_copy(model_dir, into, graph_file="model.onnx"):
    """The folder with one graph's score scaling 1% off (the full graph's divisor, a step graph's scale), its
    weights untouched (the manifest's sha256 updated, so the server serves it)."""
    shutil.copytree(model_dir, into)
    import numpy as np
    import onnx  # the export extra

    graph = onnx.load(into / graph_file)
    scaling = next(node.input[1] for node in graph.graph.node
                   if node.op_type == "Div" or (node.op_type == "Mul" and node.input[1] == "scale"))  # fmt: skip
    tensor = next(t for t in graph.graph.initializer if t.name == scaling)
    tensor.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(tensor) * np.float32(1.01), scaling))
    onnx.save(graph, into / graph_file)
    manifest = json.loads((into / "manifest.json").read_text())
    digest = next(key for key, name in manifest["files"].items() if name == graph_file)
    manifest["files"][f"{digest}_sha256"] = hashlib.sha256((into / graph_file).read_bytes()).hexdigest()
    (into / "manifest.json").write_text(json.dumps(manifest))
    return into
