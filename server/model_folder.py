"""A model folder as the server reads it, before any runtime opens a graph: its manifest checked, each graph file
proven the export's own, the device its precision allows, and what the graphs' metadata says of the model.

Every runtime of a version reads its folder through this one piece (runtime.BatchedRuntime for the full graphs,
sequences.SequenceRuntime for the step graphs), so the checks and the precision policy are made once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from mhaserve.contract.cpu import int8_support
from mhaserve.contract.model_dir import (
    METADATA_PREFIX,
    ModelDirError,
    check_model_file,
    output_only_file,
    read_manifest,
    step_file,
    summaries_file,
)
from mhaserve.contract.signature import PRECISIONS

from .session import DeviceUnavailable

log = logging.getLogger("mhaserve.server")

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class ModelInfo:
    """What the server tells clients about the model, read from the ONNX file's metadata."""

    name: str
    d_model: int
    num_heads: int
    opset: str
    path: Path
    precision: str = "fp32"  # signature.PRECISIONS; exports before float16 were float32
    # The largest input magnitude the export was validated at (its manifest's input scales); None: no limit,
    # for float32, the eager module's own arithmetic.
    max_abs_input: float | None = None
    # The largest query and key magnitude up to which a mask decides exactly (model.mha.mask_exact_input_limit,
    # from the manifest); None for folders exported before it was recorded.
    mask_exact_input_limit: float | None = None

    @property
    def computed_in(self) -> str:
        return {"fp16": "float16"}.get(self.precision, "float32")


@dataclass(frozen=True)
class ModelFolder:
    """A checked model folder: its manifest, its full graph's file (sha256 as recorded), and the device its runs
    may take (``device``: an int8 export runs on the CPU whatever was asked, its products having CPU kernels
    only)."""

    path: Path
    manifest: dict
    graph_path: Path
    device: str

    @classmethod
    def read(cls, model_dir: str | Path, device: str = "auto") -> ModelFolder:
        """The folder checked for serving on ``device`` (auto, cpu or cuda); ModelDirError says what is wrong,
        DeviceUnavailable where its precision cannot run on the device asked for."""
        model_dir = Path(model_dir)
        if device not in DEVICES:
            raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
        manifest = read_manifest(model_dir)
        # The CPU first: on one whose int8 products saturate, the export's failed validation is a consequence.
        if manifest.get("precision") == "int8":
            device = _int8_device(model_dir, device)
        if not manifest.get("valid"):
            raise ModelDirError(
                f"{model_dir}: the export failed validation (manifest 'valid' is false); "
                f"re-export it or check it with 'mhaserve validate --model-dir {model_dir}'"
            )
        return cls(model_dir, manifest, check_model_file(model_dir, manifest), device)

    @property
    def graph_sha256(self) -> str:
        return self.manifest["files"]["model_sha256"]  # as check_model_file found the file

    def output_only_path(self) -> Path | None:
        """The checked output-only graph (export/output_only.py), or None where the folder has none."""
        return output_only_file(self.path, self.manifest)

    def summaries_path(self) -> Path | None:
        """The checked summaries graph (export/summaries.py), or None where the folder has none."""
        return summaries_file(self.path, self.manifest)

    def step_path(self, kind: str) -> Path | None:
        """The checked step graph of ``kind`` (model_dir.STEP_FILES), or None where the folder has none."""
        return step_file(self.path, self.manifest, kind)

    def info(self, metadata: dict[str, str]) -> ModelInfo:
        """The model as its full graph's ``metadata`` (custom_metadata_map) and the manifest describe it."""
        try:
            info = ModelInfo(
                name=metadata.get(METADATA_PREFIX + "name", self.manifest.get("name", "mha")),
                d_model=int(metadata[METADATA_PREFIX + "d_model"]),
                num_heads=int(metadata[METADATA_PREFIX + "num_heads"]),
                opset=metadata.get(METADATA_PREFIX + "opset", "?"),
                path=self.graph_path,
                precision=metadata.get(METADATA_PREFIX + "precision", "fp32"),
            )
        except KeyError as missing:
            raise ModelDirError(
                f"{self.graph_path}: metadata_props lacks {missing}; export it with 'mhaserve export'"
            ) from None
        except ValueError as error:
            raise ModelDirError(f"{self.graph_path}: metadata_props holds a bad value ({error})") from None
        if info.precision not in PRECISIONS:
            raise ModelDirError(
                f"{self.graph_path}: metadata_props says precision {info.precision!r}; this mhaserve serves "
                f"{', '.join(PRECISIONS)}"
            )
        if info.precision != "fp32":
            info = replace(info, max_abs_input=self._validated_input_limit(info.precision))
        mask_limit = self.manifest.get("mask_exact_input_limit")
        if type(mask_limit) in (int, float) and mask_limit > 0:
            return replace(info, mask_exact_input_limit=float(mask_limit))
        log.warning(
            "%s: exported before mhaserve recorded the input range within which masks decide exactly; inputs "
            "near float32's range could give a masked key the weight. Export it again to have them refused",
            self.path,
        )
        return info

    def _validated_input_limit(self, precision: str) -> float:
        """The input magnitude up to which a reduced-precision export was validated: past it, its answers are
        refused rather than returned wrong."""
        limit = self.manifest.get("validation", {}).get("input_scales", {}).get("max_abs_input")
        if type(limit) not in (int, float) or not limit > 0:
            raise ModelDirError(
                f"{self.path}: a {precision} export without a validated input range (exported before mhaserve "
                "validated input scales, when float16 graphs lost accuracy on large inputs); re-export it"
            )
        return float(limit)


def _int8_device(model_dir: Path, device: str) -> str:
    """Where an int8 export runs: the CPU, if this one computes its products exactly (export/int8.py)."""
    support = int8_support()
    if not support.usable:
        raise ModelDirError(f"{model_dir}: {support.message}")
    if support.message is not None:
        log.warning("%s: %s", model_dir, support.message)
    if device == "cuda":
        raise DeviceUnavailable(
            f"--device cuda: {model_dir} is an int8 export, and ONNX Runtime's CUDA provider has no kernel "
            "for its uint8 x int8 products (MatMulIntegerToFloat); serve it with --device cpu, or export "
            "fp16 for the GPU"
        )
    return "cpu"
