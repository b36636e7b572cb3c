"""The model folder's layout and manifest. Torch-free: the server reads these too."""

from __future__ import annotations

import json
from pathlib import Path

MODEL_FILE = "model.onnx"
WEIGHTS_FILE = "weights.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "mhaserve-model/1"
# Keys the export writes into the ONNX model's metadata_props, so a server can describe the
# model from model.onnx alone.
METADATA_PREFIX = "mhaserve."


class ModelDirError(Exception):
    """A model folder that cannot be served: missing files, a bad manifest, or a failed validation."""


def read_manifest(model_dir: str | Path) -> dict:
    path = Path(model_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelDirError(f"{path}: no manifest; export a model with 'mhaserve export'") from None
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"{path}: not valid JSON ({exc})") from None
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ModelDirError(f"{path}: format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    return manifest


def write_manifest(model_dir: str | Path, manifest: dict) -> None:
    path = Path(model_dir) / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)  # readers never see half a manifest
