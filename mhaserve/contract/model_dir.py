"""The model folder's layout and manifest, which export writes and the server reads: torch-free."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

from mhaserve.contract.errors import json_kind
from mhaserve.contract.signature import PRECISIONS

MODEL_FILE = "model.onnx"
# The same model without the attention-weights output, for requests that ask for none of them (written for
# float32 exports; a folder without it, float16 or exported before it existed, serves them from model.onnx).
OUTPUT_ONLY_FILE = "model_output_only.onnx"
SUMMARIES_FILE = "model_summaries.onnx"
# What a current summaries graph does with the weights: never makes them whole (export/summaries.py).
SUMMARIES_WEIGHTS_NEVER_WHOLE = "the weights never made whole"
# What a current step graph does with a sequence's cache: returns its new rows, written in place after the others.
STEP_CACHE_IN_PLACE = "new rows written in place"
STEP_FILE = "model_step.onnx"  # one step of a growing sequence, over the keys and values the server keeps
CROSS_STEP_FILE = "model_cross_step.onnx"  # one step of a cross-attention sequence: queries over keys given to it
# Steps of several sequences in one run, each over its own keys and values where they lie (self-attention, cross).
GROUPED_STEP_FILE = "model_grouped_steps.onnx"
GROUPED_CROSS_STEP_FILE = "model_grouped_cross_steps.onnx"
STEP_FILES = {"step": STEP_FILE, "cross_step": CROSS_STEP_FILE, "grouped_step": GROUPED_STEP_FILE,
              "grouped_cross_step": GROUPED_CROSS_STEP_FILE}  # manifest keys  # fmt: skip
WEIGHTS_FILE = "weights.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "mhaserve-model/1"
# Keys the export writes into the ONNX model's metadata_props, so a server can describe the
# model from model.onnx alone.
METADATA_PREFIX = "mhaserve."
# A width beyond any served attention layer (4096 is the largest typical one): a manifest claiming more
# is damaged, and sizing message limits from it would ask for absurd buffers.
MAX_D_MODEL = 65536


class ModelDirError(Exception):
    """A model folder that cannot be served: missing files, a bad manifest, or a failed validation."""


def manifest_missing(folder: Path) -> str | None:
    """Why ``folder`` is no model folder, naming what was likely meant (a file in one, a repository of them); None
    where its manifest is there."""
    if (folder / MANIFEST_FILE).is_file():
        return None
    if not folder.exists():
        return f"{folder}: no such folder; give a model folder 'mhaserve export' wrote"
    if not folder.is_dir():
        return f"{folder}: a file, not a model folder; give the folder 'mhaserve export' wrote"
    versions = sorted(folder.glob(f"*/*/{MANIFEST_FILE}"))
    if versions:
        version = versions[0].parent
        return (
            f"{folder}: a model repository, not a model folder (its versions are folders like {version}); serve "
            f"it with --model-repository {folder}"
        )
    return f"{folder / MANIFEST_FILE}: no manifest; export a model with 'mhaserve export'"


def read_manifest(model_dir: str | Path) -> dict:
    """The folder's manifest, its shape checked: every problem is a ModelDirError naming the field."""
    path = Path(model_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except (FileNotFoundError, NotADirectoryError):
        raise ModelDirError(manifest_missing(Path(model_dir)) or f"{path}: gone while read") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelDirError(f"{path}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ModelDirError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise ModelDirError(f"{path}: holds a JSON {json_kind(manifest)}, expected an object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ModelDirError(f"{path}: format {manifest.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    config = manifest.get("config")
    if not isinstance(config, dict):
        raise ModelDirError(f"{path}: 'config' is {config!r}, expected an object with d_model and num_heads")
    for name in ("d_model", "num_heads"):
        value = config.get(name)
        if type(value) is not int or not 1 <= value <= MAX_D_MODEL:
            raise ModelDirError(f"{path}: config '{name}' is {value!r}, expected an integer from 1 to {MAX_D_MODEL}")
    if manifest.get("precision", "fp32") not in PRECISIONS:
        raise ModelDirError(f"{path}: precision {manifest['precision']!r}, expected one of {', '.join(PRECISIONS)}")
    if config["d_model"] % config["num_heads"]:
        raise ModelDirError(
            f"{path}: config d_model {config['d_model']} is not divisible by num_heads {config['num_heads']}"
        )
    return manifest


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_model_file(model_dir: str | Path, manifest: dict, name: str = MODEL_FILE) -> Path:
    """A graph file as exported: its sha256 is the one the manifest recorded (a changed weight, a truncated
    copy or a half-written file is refused); returns its path."""
    path = Path(model_dir) / name
    recorded = manifest.get("files", {}).get(_SHA256_KEYS[name])
    if not path.is_file():
        raise ModelDirError(f"{path}: missing; re-export the folder with 'mhaserve export'")
    if recorded is None:
        raise ModelDirError(f"{path}: the manifest records no sha256 for it (an older export); re-export it")
    found = file_sha256(path)
    if found != recorded:
        raise ModelDirError(
            f"{path}: sha256 {found[:16]}... differs from the manifest's {recorded[:16]}...: the file changed "
            "after export (or was cut short); re-export it"
        )
    return path


_SHA256_KEYS = {MODEL_FILE: "model_sha256", OUTPUT_ONLY_FILE: "output_only_sha256", SUMMARIES_FILE: "summaries_sha256",
                **{name: f"{key}_sha256" for key, name in STEP_FILES.items()}}  # fmt: skip


def output_only_file(model_dir: str | Path, manifest: dict) -> Path | None:
    """The checked output-only graph, or None for a folder exported without one."""
    if manifest.get("files", {}).get("output_only") != OUTPUT_ONLY_FILE:
        return None
    return check_model_file(model_dir, manifest, OUTPUT_ONLY_FILE)


def summaries_file(model_dir: str | Path, manifest: dict) -> Path | None:
    """The checked summaries graph, or None for a folder exported without one."""
    if manifest.get("files", {}).get("summaries") != SUMMARIES_FILE:
        return None
    return check_model_file(model_dir, manifest, SUMMARIES_FILE)


def step_file(model_dir: str | Path, manifest: dict, kind: str = "step") -> Path | None:
    """The checked step graph of ``kind`` (a key of STEP_FILES), or None for a folder exported without one
    (float16, int8, or an older export)."""
    name = STEP_FILES[kind]
    if manifest.get("files", {}).get(kind) != name:
        return None
    return check_model_file(model_dir, manifest, name)


def why_not_current(model_dir: str | Path, wanted: Mapping[str, object] | None = None) -> str | None:
    """Why ``model_dir`` does not hold a valid, intact export that serves as it is (float32 folders: with the
    output-only graph and the batched step graph), of what ``wanted`` says (manifest keys, and the values an
    export would write there); None if it does."""
    try:
        manifest = read_manifest(model_dir)
        check_model_file(model_dir, manifest)
        output_only = output_only_file(model_dir, manifest)
        summaries = summaries_file(model_dir, manifest)
        step = step_file(model_dir, manifest)
        cross_step = step_file(model_dir, manifest, "cross_step")
        grouped_steps = [step_file(model_dir, manifest, kind) for kind in ("grouped_step", "grouped_cross_step")]
    except ModelDirError as error:
        return str(error) if Path(model_dir).exists() else "there is none yet"
    if not manifest.get("valid"):
        return "its validation failed"
    for key, value in (wanted or {}).items():
        if manifest.get(key) != value:
            return f"it holds {key} {manifest.get(key)!r}, not {value!r}"
    if manifest.get("precision", "fp32") != "fp32":
        return None  # float16 and int8 folders have neither graph
    if output_only is None:
        return "an older export, without the output-only graph"
    if summaries is None:
        return "an older export, without the summaries graph"
    if manifest["validation"].get("summaries", {}).get("graph") != SUMMARIES_WEIGHTS_NEVER_WHOLE:
        return "an older export, whose summaries graph makes the weights whole"
    if step is None:
        return "an older export, without the step graph that serves sequences"
    if manifest.get("validation", {}).get("step", {}).get("cache") != STEP_CACHE_IN_PLACE:
        return "an older export, whose step graph returns a sequence's whole cache at every step"
    if cross_step is None:
        return "an older export, without the step graph that serves cross-attention sequences"
    if None in grouped_steps:
        return "an older export, without the step graphs that run steps of several sequences together"
    return None


def write_manifest(model_dir: str | Path, manifest: dict) -> None:
    path = Path(model_dir) / MANIFEST_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)  # readers never see half a manifest
