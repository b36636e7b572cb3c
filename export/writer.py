"""Write and re-validate a model folder: model.onnx, weights.pt and manifest.json."""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

import mhaserve
from mhaserve.contract.errors import UsageError
from mhaserve.contract.model_dir import (
    MANIFEST_FORMAT,
    METADATA_PREFIX,
    MODEL_FILE,
    OUTPUT_ONLY_FILE,
    STEP_CACHE_IN_PLACE,
    STEP_FILES,
    SUMMARIES_FILE,
    SUMMARIES_WEIGHTS_NEVER_WHOLE,
    WEIGHTS_FILE,
    file_sha256,
    read_manifest,
    write_manifest,
)
from mhaserve.contract.steps import steps_grouped
from mhaserve.model import (
    MultiHeadAttention,
    declared_heads,
    load_weights,
    mask_exact_input_limit,
    module_from_state_dict,
    save_weights,
)

from .onnx_export import DEFAULT_OPSET, check_onnx, export_onnx, save_onnx
from .output_only import output_only_graph
from .step import STEP_VALIDATIONS, step_graphs
from .summaries import summaries_graph, validate_summaries
from .validate import (
    SCALE_TOLERANCES,
    TOLERANCES,
    ServedModuleReference,
    TorchMultiheadAttentionReference,
    UserModuleReference,
    export_holds,
    input_limit,
    max_errors,
    report_to_stderr,
    status_counts,
    validate_graphs,
    validate_scales_graphs,
    worst_failure,
)

_ONNX_DTYPES = {
    onnx.TensorProto.FLOAT: "float32",
    onnx.TensorProto.FLOAT16: "float16",
    onnx.TensorProto.BOOL: "bool",
}


def describe_tensors(values) -> list[dict]:
    """Name, dtype and shape (dynamic dims by name) of graph inputs or outputs."""
    described = []
    for value in values:
        tensor_type = value.type.tensor_type
        dims = [d.dim_param if d.dim_param else d.dim_value for d in tensor_type.shape.dim]
        dtype = _ONNX_DTYPES.get(tensor_type.elem_type, onnx.TensorProto.DataType.Name(tensor_type.elem_type))
        described.append({"name": value.name, "dtype": dtype, "shape": dims})
    return described


VALIDATION_FILE = "validation.txt"  # every validation row of the export, as it was printed


def export_identity(module: MultiHeadAttention, *, name: str, precision: str, opset: int, source: dict | None) -> dict:
    """What a folder's manifest says it is an export of: its name, the module's sizes, the precision, the opset and
    where the weights came from (``mhaserve export --keep-current`` keeps a folder whose manifest says the same)."""
    return {
        "name": name,
        "config": {"d_model": module.d_model, "num_heads": module.num_heads, "d_k": module.d_k},
        "precision": precision,
        "opset": opset,
        "source": source or {"kind": "module"},
    }


def export_model_dir(
    module: MultiHeadAttention,
    out_dir: str | Path,
    *,
    opset: int = DEFAULT_OPSET,
    precision: str = "fp32",
    source: dict | None = None,
    name: str = "mha",
    validation_seed: int | None = None,
    report: Callable[[str], None] | None = None,
    reference=None,
) -> dict:
    """Export, check, validate and write ``out_dir``; returns the manifest ("valid" says if it passed).

    ``precision`` is what the graph computes in (signature.PRECISIONS); it is validated against the float32
    eager module, within that precision's tolerance (validate.TOLERANCES).
    ``reference`` is what the export is validated against (default: ``module`` itself; see validate.py).
    ``source`` says where the weights came from. A folder whose validation failed is still written, for
    inspection, with "valid": false.
    """
    out_dir = Path(out_dir)
    module = module.eval()
    started = time.perf_counter()
    rows: list[str] = []  # the whole validation table, kept in the folder (VALIDATION_FILE)
    shown = report or report_to_stderr

    def report(line: str) -> None:
        rows.append(line)
        shown(line)

    graphs = _Graphs.of(module, opset, precision)
    if validation_seed is None:
        validation_seed = int(np.random.SeedSequence().entropy % 2**32)
    reference = reference if reference is not None else module
    validation = _Validation.of(graphs, reference, module, validation_seed, report, precision)
    identity = export_identity(module, name=name, precision=precision, opset=opset, source=source)
    manifest = _manifest(identity, graphs, validation, module, validation_seed, precision)
    manifest["export_seconds"] = round(time.perf_counter() - started, 2)
    graphs.stamp(module, manifest, name=name, opset=opset, precision=precision)
    _write_folder(out_dir, graphs, module, manifest, rows)
    return manifest


@dataclass
class _Graphs:
    """The graphs of one export: the full one, its output-only one (float32 only: the float16 graph splits its
    precision by path, which the fused kernel cannot), its summaries one (float32 only), and the step graphs that
    serve sequences (float32 only)."""

    model: onnx.ModelProto
    output_only: onnx.ModelProto | None
    steps: dict[str, onnx.ModelProto]
    summaries: onnx.ModelProto | None = None

    @classmethod
    def of(cls, module: MultiHeadAttention, opset: int, precision: str) -> _Graphs:
        model = export_onnx(module, opset, precision)
        output_only = output_only_graph(module) if precision == "fp32" else None
        summaries = summaries_graph(model) if precision == "fp32" else None
        steps = step_graphs(module) if precision == "fp32" else {}
        for graph in (model, output_only, summaries, *steps.values()):
            if graph is not None:
                check_onnx(graph)
        return cls(model, output_only, steps, summaries)

    def stamp(self, module: MultiHeadAttention, manifest: dict, *, name: str, opset: int, precision: str) -> None:
        """The model's description in the metadata of the graphs a server reads it from."""
        metadata = {
            "name": name,
            "d_model": module.d_model,
            "num_heads": module.num_heads,
            "opset": opset,
            "precision": precision,
            "valid": manifest["valid"],
            "mask": manifest["mask"],
            "torch_version": torch.__version__,
            "mhaserve_version": mhaserve.__version__,
        }
        for graph in (g for g in (self.model, self.output_only, self.steps.get("step")) if g is not None):
            onnx.helper.set_model_props(graph, {METADATA_PREFIX + k: str(v) for k, v in metadata.items()})
            graph.producer_name = "mhaserve"
            graph.producer_version = mhaserve.__version__


@dataclass
class _Validation:
    """Each graph's validation against the eager module: the full graph's cases and input scales, the output-only
    graph's (None where there is none), and each step graph's cases."""

    results: list
    scales: list
    output_only: tuple[list, list] | None
    steps: dict[str, list[dict]]
    summaries: list[dict] | None = None  # the summaries graph's cases (None: no such graph)

    @classmethod
    def of(cls, graphs: _Graphs, reference, module, seed: int, report, precision: str) -> _Validation:
        output_only = graphs.output_only
        (results, scales), *only = _validate_answering_graphs(
            reference,
            module,
            graphs.model.SerializeToString(),
            None if output_only is None else output_only.SerializeToString(),
            seed,
            report,
            precision,
        )
        steps = {
            kind: STEP_VALIDATIONS[kind](module, graph.SerializeToString(), seed, report)
            for kind, graph in graphs.steps.items()
        }
        summaries = None
        if graphs.summaries is not None:
            summaries = validate_summaries(module, graphs.summaries.SerializeToString(), seed, report)
        return cls(results, scales, only[0] if only else None, steps, summaries)

    @property
    def passed(self) -> bool:
        answering = [(self.results, self.scales), *([self.output_only] if self.output_only else [])]
        steps_pass = all(r["status"] == "pass" for results in self.steps.values() for r in results)
        summaries_pass = all(r["status"] == "pass" for r in self.summaries or ())
        return all(export_holds(results, scales) for results, scales in answering) and steps_pass and summaries_pass


def _manifest(identity: dict, graphs: _Graphs, validation: _Validation, module, seed: int, precision: str) -> dict:
    """The folder's manifest.json: what was exported, from what, and how each graph validated."""
    passed = validation.passed
    results, scales = validation.results, validation.scales
    manifest = {
        "format": MANIFEST_FORMAT,
        **identity,
        "valid": passed,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "files": {"model": MODEL_FILE, "weights": WEIGHTS_FILE},
        "inputs": describe_tensors(graphs.model.graph.input),
        "outputs": describe_tensors(graphs.model.graph.output),
        "mask": "0/False = may not attend; rank 4 [B|1, 1, Lq|1, Lk]; a fully masked query row gives zeros",
        # the largest query and key magnitude up to which a mask decides exactly: the server refuses inputs past it
        "mask_exact_input_limit": mask_exact_input_limit(module),
        "exporter": "torch.onnx (torch.export, dynamo=True)",
        "versions": {
            "mhaserve": mhaserve.__version__,
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": ort.__version__,
        },
        "validation": {
            "passed": passed,
            "tolerance": asdict(TOLERANCES[precision]),
            # where an export that does not hold is furthest past its tolerance (None where it holds)
            "worst_failure": worst_failure(results, scales, precision),
            "seed": seed,
            "counts": status_counts(results),
            "cases": [r.as_dict() for r in results],
            "input_scales": {
                "tolerance": asdict(SCALE_TOLERANCES[precision]),
                # the largest input magnitude up to which every scale held: the server refuses inputs past it
                "max_abs_input": input_limit(scales),
                "scales": [r.as_dict() for r in scales],
            },
        },
    }
    if validation.output_only is not None:
        only_results, only_scales = validation.output_only
        manifest["files"]["output_only"] = OUTPUT_ONLY_FILE
        manifest["validation"]["output_only"] = {
            "passed": export_holds(only_results, only_scales),
            "counts": status_counts(only_results),
            "cases": [r.as_dict() for r in only_results],
            "input_scales": {
                "max_abs_input": input_limit(only_scales),
                "scales": [r.as_dict() for r in only_scales],
            },
        }
    if validation.summaries is not None:
        manifest["files"]["summaries"] = SUMMARIES_FILE
        manifest["validation"]["summaries"] = {
            "passed": all(r["status"] == "pass" for r in validation.summaries),
            "cases": validation.summaries,
            "graph": SUMMARIES_WEIGHTS_NEVER_WHOLE,
        }
    for kind, step_results in validation.steps.items():
        manifest["files"][kind] = STEP_FILES[kind]
        manifest["validation"][kind] = {
            "passed": all(r["status"] == "pass" for r in step_results),
            "cases": step_results,
        }
    if graphs.steps:
        manifest["validation"]["step"]["cache"] = STEP_CACHE_IN_PLACE
        for kind in ("grouped_step", "grouped_cross_step"):
            manifest["validation"][kind]["members"] = steps_grouped(module.d_model)
    return manifest


def _write_folder(out_dir: Path, graphs: _Graphs, module, manifest: dict, rows: list[str]) -> None:
    """The folder written beside the target and renamed into place: a failed write (a full disk) leaves the folder
    that was there untouched, and a folder under this name is always complete."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        save_onnx(graphs.model, staging / MODEL_FILE)
        save_weights(module, staging / WEIGHTS_FILE)
        manifest["files"]["model_sha256"] = file_sha256(staging / MODEL_FILE)
        if graphs.output_only is not None:
            save_onnx(graphs.output_only, staging / OUTPUT_ONLY_FILE)
            manifest["files"]["output_only_sha256"] = file_sha256(staging / OUTPUT_ONLY_FILE)
        if graphs.summaries is not None:
            save_onnx(graphs.summaries, staging / SUMMARIES_FILE)
            manifest["files"]["summaries_sha256"] = file_sha256(staging / SUMMARIES_FILE)
        for kind, graph in graphs.steps.items():
            save_onnx(graph, staging / STEP_FILES[kind])
            manifest["files"][f"{kind}_sha256"] = file_sha256(staging / STEP_FILES[kind])
        (staging / VALIDATION_FILE).write_text("\n".join(rows) + "\n")
        write_manifest(staging, manifest)
        _replace_dir(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _validate_answering_graphs(
    reference,
    module: MultiHeadAttention,
    graph: bytes | str,
    output_only: bytes | str | None,
    seed: int | None,
    report: Callable[[str], None] | None,
    precision: str,
) -> list[tuple[list, list]]:
    """The validation matrix and the input scales on the graph that answers requests, and on its output-only
    graph where there is one (its output against the same reference and the same exact answer, each case's
    reference computed once for both, its table rows marked as such): (cases, scales) for each."""
    report = report or report_to_stderr
    graphs = [(graph, report)]
    if output_only is not None:
        graphs.append((output_only, lambda line: report(f"output-only graph: {line}")))
    results = validate_graphs(reference, graphs, seed=seed, precision=precision)
    scales = validate_scales_graphs(module, graphs, seed=seed, precision=precision)
    return list(zip(results, scales, strict=True))


def _replace_dir(new: Path, target: Path) -> None:
    if not target.exists():
        new.rename(target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    target.rename(old)
    new.rename(target)
    shutil.rmtree(old, ignore_errors=True)


def revalidate_model_dir(
    model_dir: str | Path, seed: int | None = None, report: Callable[[str], None] | None = None
) -> bool:
    """Re-run the validation matrix on an existing folder, against its own weights."""
    model_dir = Path(model_dir)
    manifest = read_manifest(model_dir)
    module = load_weights(model_dir / WEIGHTS_FILE)
    precision = manifest.get("precision", "fp32")
    has_output_only = manifest.get("files", {}).get("output_only") == OUTPUT_ONLY_FILE
    (results, scales), *only = _validate_answering_graphs(
        module,
        module,
        str(model_dir / MODEL_FILE),
        str(model_dir / OUTPUT_ONLY_FILE) if has_output_only else None,
        seed,
        report,
        precision,
    )
    holds = export_holds(results, scales) and all(export_holds(*checked) for checked in only)
    failure = worst_failure(results, scales, precision)
    if failure is not None:
        (report or report_to_stderr)(failure)
    for kind, validate_graph in STEP_VALIDATIONS.items():
        if manifest.get("files", {}).get(kind) == STEP_FILES[kind]:
            results = validate_graph(module, str(model_dir / STEP_FILES[kind]), seed, report or report_to_stderr)
            holds = holds and all(r["status"] == "pass" for r in results)
    return holds


def reference_of(module: torch.nn.Module):
    """What an export of ``module``'s weights is validated against: the module's own eager answers."""
    if isinstance(module, torch.nn.MultiheadAttention):
        return TorchMultiheadAttentionReference(module)
    if isinstance(module, MultiHeadAttention):  # mhaserve's own module, trained: forward(query, key, value, mask)
        return ServedModuleReference(module)
    return UserModuleReference(module)


def export_module(
    module: torch.nn.Module,
    out_dir: str | Path,
    *,
    num_heads: int | None = None,
    prefix: str | None = None,
    name: str = "mha",
    opset: int = DEFAULT_OPSET,
    precision: str = "fp32",
    validation_seed: int | None = None,
    report: Callable[[str], None] | None = None,
) -> dict:
    """Export the user's own attention module to a validated model folder; returns the manifest.

    ``module`` has the design documents' interface (``forward(query, key, value, mask)`` or
    ``forward(x, mask)``, returning the output or ``(output, weights)``), or is an
    ``nn.MultiheadAttention``. Its weights (found in its state dict as ``mhaserve export --weights``
    finds them in a file; ``prefix`` picks one layer of several) go into the served graph, and the
    export is validated against the module's own eager output. ``num_heads`` defaults to the module's
    ``num_heads`` (or ``n_heads``, ``h``, ...) attribute; given as well, the two must agree.
    """
    where = type(module).__name__
    found = declared_heads(module)
    if num_heads is not None and found is not None and found != num_heads:
        raise UsageError(f"{where} has {found} heads, num_heads={num_heads} says otherwise")
    if num_heads is None:
        num_heads = found
    served, layer = module_from_state_dict(module.state_dict(), num_heads, prefix, where)
    reference = reference_of(module.get_submodule(layer.prefix.removesuffix(".")))
    source = {
        "kind": "module",
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "layout": layer.layout.name,
        "prefix": layer.prefix,
    }
    return export_model_dir(
        served,
        out_dir,
        opset=opset,
        precision=precision,
        source=source,
        name=name,
        validation_seed=validation_seed,
        report=report,
        reference=reference,
    )


def _check_same_weights(model_dir: Path, against: Path) -> None:
    """Refuses an ``against`` folder that is no float32 export of ``model_dir``'s weights: its answers would differ
    for another reason than precision."""
    precision = read_manifest(against).get("precision", "fp32")
    if precision != "fp32":
        raise UsageError(f"--against {against}: exported in {precision}; give a float32 one")
    ours, theirs = (load_weights(folder / WEIGHTS_FILE).state_dict() for folder in (model_dir, against))
    for name, tensor in ours.items():
        other = theirs[name]
        if tensor.shape != other.shape or not torch.equal(tensor, other):
            differ = "its shape" if tensor.shape != other.shape else f"up to {float((tensor - other).abs().max()):.3g}"
            raise UsageError(f"--against {against}: holds other weights than {model_dir} ({name} differs by {differ})")


def check_on_inputs(
    model_dir: str | Path,
    feeds: dict[str, np.ndarray],
    inputs: str,
    against: str | Path | None = None,
    report: Callable[[str], None] | None = None,
) -> bool:
    """The folder's answers on a user's own inputs against float32's: eager PyTorch on the folder's own weights, or
    the answers of ``against`` (another folder, a float32 export of the same weights). ``feeds`` are the inputs in
    the served form (``query``, ``key``, ``value`` FP32 and the rank-4 BOOL ``mask``, as the server checks a
    request into), read from what ``inputs`` names. Reports the worst errors; True where they are within the
    folder's precision's tolerance (validate.TOLERANCES)."""
    report = report or report_to_stderr
    model_dir = Path(model_dir)
    precision = read_manifest(model_dir).get("precision", "fp32")
    tolerance = TOLERANCES[precision]
    query, key = feeds["query"], feeds["key"]
    session = ort.InferenceSession(str(model_dir / MODEL_FILE), providers=["CPUExecutionProvider"])
    got = session.run(["output", "attn_weights"], feeds)
    if against is None:
        module = load_weights(model_dir / WEIGHTS_FILE)
        with torch.no_grad():
            want = [t.numpy() for t in module(*(torch.from_numpy(feeds[n]) for n in ("query", "key", "value", "mask")))]
        reference = "eager float32 PyTorch on its weights"
    else:
        _check_same_weights(model_dir, Path(against))
        other = ort.InferenceSession(str(Path(against) / MODEL_FILE), providers=["CPUExecutionProvider"])
        want = other.run(["output", "attn_weights"], feeds)
        reference = str(against)
    (out_abs, out_rel), (attn_abs, attn_rel) = (max_errors(g, w) for g, w in zip(got, want, strict=True))
    within = tolerance.output.allows(out_abs, out_rel) and tolerance.weights.allows(attn_abs, attn_rel)
    report(
        f"{model_dir} ({precision}) against {reference}, on {inputs} (query {list(query.shape)}, key "
        f"{list(key.shape)}): output abs {out_abs:.2e} rel {out_rel:.2e}; weights abs {attn_abs:.2e} rel "
        f"{attn_rel:.2e}: {'within' if within else 'NOT within'} the {precision} tolerance ({tolerance})"
    )
    return within
