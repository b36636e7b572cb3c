"""``mhaserve export`` and ``mhaserve validate``: a model folder written, validated against eager PyTorch, and
checked again."""

from __future__ import annotations

import sys
from pathlib import Path

from mhaserve.contract.errors import UsageError
from mhaserve.contract.signature import PRECISIONS

from .common import add_model_dir, check_folder_can_be_made, check_writable_folder, count, index, require_extra


def add_export(sub) -> None:
    p = sub.add_parser("export", help="export the MHA module to a validated ONNX model folder")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None, help="model folder to write (default model_repository/mha)")
    where.add_argument("--repository", type=Path, help="write the next version of --name into this model repository "
                       "(DIR/NAME/<n+1>/); a server polling it picks the version up")  # fmt: skip
    p.add_argument("--d-model", type=count, default=None, help="model width of the seeded module (default 512)")
    p.add_argument("--heads", type=count, default=None, help="number of heads; must divide d-model (default 8; "
                   "with --weights, required unless the file says)")  # fmt: skip
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--seed", type=index, default=0, help="seed of the default initialisation (default 0)")
    weights.add_argument("--weights", type=Path, help="trained weights: a state dict (.pt/.pth/.bin/.safetensors) of "
                         "a module with W_q..W_o or w_q..w_o, nn.MultiheadAttention, BERT, ViT, DistilBERT, "
                         "BART-style q_proj..out_proj (BART, OPT, Whisper), GPT-2's c_attn and c_proj, or "
                         "mhaserve's own file; or a folder Hugging Face's save_pretrained wrote")  # fmt: skip
    p.add_argument("--prefix", help="the key prefix of one attention layer in --weights (e.g. encoder.layers.3.)")
    p.add_argument("--trust-module", action="store_true", help="with --weights of a whole saved module "
                   "(torch.save(model)): also load it as torch.load does, running the code it was saved with (only "
                   "for a file you trust; its classes must be importable), and validate the export against its own "
                   "answers instead of against its weights in mhaserve's module")  # fmt: skip
    p.add_argument("--opset", type=count, default=None, help="ONNX opset (default 18)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="what the graph computes in; fp16 "
                   "takes and returns float32 but returns the attention weights in float16; int8 computes the four "
                   "projections in int8, validated within its own tolerance (default fp32)")  # fmt: skip
    p.add_argument("--name", default="mha", help="model name the server registers; with --repository, the model's "
                   "folder (default mha)")  # fmt: skip
    p.add_argument("--validation-seed", type=index, default=None, help="seed of the validation inputs (default random)")
    p.add_argument("--triton-repo", type=Path, help="also write a Triton model repository (config.pbtxt, 1/model.onnx)")
    p.add_argument("--keep-current", action="store_true", help="if --out already holds a valid, intact export of "
                   "these weights and settings, keep it and exit 0 instead of exporting again (Compose's export "
                   "service, at every 'up')")  # fmt: skip
    p.add_argument("--verbose", action="store_true", help="print every validation row (default: the summaries and "
                   "any failing row; every row goes to the folder's validation.txt)")  # fmt: skip
    p.set_defaults(run=_run_export)


class ValidationProgress:
    """The export's validation on the terminal: its summaries and any row that did not pass (every row with
    ``verbose``); on a terminal, the rows counted on one line as they go. The whole table is in the folder."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.counting = sys.stderr.isatty()
        self.rows = 0

    def __call__(self, line: str) -> None:
        case = line
        for graph in ("output-only graph: ", "step graph: ", "cross step graph: "):
            case = case.removeprefix(graph)
        row = case.startswith(("[", "sequences "))  # a case of a graph's validation, printed if it failed
        if self.verbose or not row or not line.rstrip().endswith("pass"):
            self._end_count()
            print(line, file=sys.stderr, flush=True)
        elif self.counting:
            self.rows += 1
            print(f"\rvalidating: {self.rows} cases passed", end="", file=sys.stderr, flush=True)

    def _end_count(self) -> None:
        if self.rows:
            print(file=sys.stderr)
            self.rows = 0


def _export_dir(args) -> Path:
    """--out, or the next version folder of --name in --repository."""
    if args.repository is None:
        return args.out or Path("model_repository/mha")
    from mhaserve.contract.repository import ModelRepository, RepositoryPathError

    repository = ModelRepository(args.repository)
    try:
        return repository.version_dir(args.name, repository.next_version(args.name))
    except RepositoryPathError as error:
        raise UsageError(f"--name: {error}") from None


def _run_export(args) -> int:
    if args.keep_current and args.repository is not None:
        raise UsageError("--keep-current keeps what --out holds; --repository always writes a new version")
    args.out = _export_dir(args)  # before torch is imported: a wrong path is refused at once
    check_folder_can_be_made(args.out, "--out" if args.repository is None else "--repository")
    if args.triton_repo:
        check_writable_folder(args.triton_repo, "--triton-repo")
    require_extra("export", "mhaserve export")

    from mhaserve.export.onnx_export import DEFAULT_OPSET
    from mhaserve.export.writer import export_identity, export_model_dir

    if args.opset is not None and args.opset < DEFAULT_OPSET:
        raise UsageError(f"--opset {args.opset}: the export is written for opset {DEFAULT_OPSET} and later")
    module, source, reference = _module_to_export(args)
    opset = args.opset or DEFAULT_OPSET
    if args.keep_current:
        from mhaserve.contract.model_dir import why_not_current

        wanted = export_identity(module, name=args.name, precision=args.precision, opset=opset, source=source)
        why = why_not_current(args.out, wanted)
        if why is None:
            print(f"{args.out} already holds this export, valid and intact: kept", file=sys.stderr)
            _write_triton_repo(args)
            return 0
        print(f"{args.out}: {why}", file=sys.stderr)
    print(
        f"exporting MHA d_model={module.d_model} heads={module.num_heads} in {args.precision} to {args.out} "
        f"and validating it against eager PyTorch",
        file=sys.stderr,
    )
    if args.precision == "int8":
        from mhaserve.contract.cpu import int8_support

        if (warning := int8_support().message) is not None:  # refused or not, validation says if it holds here
            print(f"warning: {warning}", file=sys.stderr)
    manifest = export_model_dir(
        module,
        args.out,
        opset=opset,
        precision=args.precision,
        source=source,
        name=args.name,
        validation_seed=args.validation_seed,
        report=ValidationProgress(args.verbose),
        reference=reference,
    )
    verdict = "valid" if manifest["valid"] else "NOT valid (validation failed)"
    failure = manifest["validation"]["worst_failure"]
    if failure is not None:
        verdict += f"; {failure}"
    if not args.verbose:
        print(f"every validation row: {args.out / 'validation.txt'}", file=sys.stderr)
    print(f"wrote {args.out} in {manifest['export_seconds']} s: {verdict}", file=sys.stderr)
    if manifest["valid"]:
        _write_model_config(args, module)
        _write_triton_repo(args)
    return 0 if manifest["valid"] else 1


def _module_to_export(args) -> tuple:
    """The module to export (the user's weights, or a seeded one), where its weights came from, and what it is
    validated against where not itself (--trust-module: the saved module)."""
    from mhaserve.model import DEFAULT_D_MODEL, DEFAULT_NUM_HEADS, load_checkpoint, seeded_module

    reference = None  # what the export is validated against, where not its own module (--trust-module)
    if args.weights:
        module, source = load_checkpoint(args.weights, args.heads, args.prefix)
        if args.d_model is not None and args.d_model != module.d_model:
            raise UsageError(f"--d-model {args.d_model}, but {args.weights} holds d_model {module.d_model}")
        saved = f" (a saved {source['module_class']})" if "module_class" in source else ""
        print(f"read {source['layout']} weights at prefix {source['prefix']!r} from {args.weights}{saved}: "
              f"d_model {module.d_model} (from the shapes), {module.num_heads} heads (from {source['heads_from']})",
              file=sys.stderr)  # fmt: skip
        if "biases_absent" in source:
            print(f"note: {args.weights} holds no {', '.join(source['biases_absent'])}: those projections have no "
                  "bias and are served with zeros, the same computation", file=sys.stderr)  # fmt: skip
        if args.trust_module:
            if "module_class" not in source:
                raise UsageError(f"--trust-module: {args.weights} holds tensors, not a whole saved module")
            from mhaserve.export.writer import reference_of
            from mhaserve.model.checkpoint import load_saved_module

            reference = reference_of(load_saved_module(args.weights, source["prefix"]))
            source["validated_against"] = "the saved module"
            print(f"validating against the saved {source['module_class']} itself (--trust-module)", file=sys.stderr)
        if source["heads_from"] == "--heads":
            print(f"note: {args.weights} does not say its number of heads; {module.num_heads} is taken from --heads "
                  "as given: a wrong count validates (it is checked against these weights, not your module) but "
                  "answers unlike your module. export_module(your_module) checks against the module itself",
                  file=sys.stderr)  # fmt: skip
    else:
        if args.prefix is not None or args.trust_module:
            flag = "--prefix picks a layer of" if args.prefix is not None else "--trust-module loads"
            raise UsageError(f"{flag} --weights; there is no --weights")
        try:
            module = seeded_module(args.d_model or DEFAULT_D_MODEL, args.heads or DEFAULT_NUM_HEADS, args.seed)
        except ValueError as error:  # sizes that do not fit: the module's own message says how
            raise UsageError(str(error)) from None
        source = {"kind": "seed", "seed": args.seed}
    return module, source, reference


def _write_model_config(args, module) -> None:
    """The model's config.pbtxt where the server reads it (beside the version folders in a repository, else in
    the folder), with every setting commented out; one already there is the user's and stays as it is."""
    from mhaserve.contract.repository import MODEL_CONFIG_FILE
    from mhaserve.server.model_config import config_template

    path = (args.repository / args.name if args.repository is not None else args.out) / MODEL_CONFIG_FILE
    if path.exists():
        return
    description = {"d_model": module.d_model, "num_heads": module.num_heads, "precision": args.precision}
    path.write_text(config_template(args.name, description))
    print(f"wrote {path}: how the server serves the model, every setting commented out (the server's flags apply)",
          file=sys.stderr)  # fmt: skip


def _write_triton_repo(args) -> None:
    """With --triton-repo, the valid folder --out as a Triton model too."""
    if args.triton_repo:
        from mhaserve.export.triton_repo import write_triton_repo

        print(f"wrote Triton model {write_triton_repo(args.out, args.triton_repo)}", file=sys.stderr)


def add_validate(sub) -> None:
    p = sub.add_parser("validate", help="re-run the validation matrix on an exported model folder")
    add_model_dir(p, "the model folder 'mhaserve export' wrote", required=True)
    p.add_argument("--seed", type=index, default=None, help="seed of the validation inputs (default random)")
    p.add_argument("--inputs", type=Path, help="instead, compare the folder's answers on your own inputs (an .npz "
                   "with query and optionally key, value, mask, as 'mhaserve infer --save' writes) against float32's, "
                   "within the folder's precision's tolerance")  # fmt: skip
    p.add_argument("--against", type=Path, help="with --inputs: a float32 folder of the same weights to compare "
                   "against (default: eager float32 PyTorch on the folder's own weights)")  # fmt: skip
    p.set_defaults(run=_run_validate)


def _checked_inputs(model_dir: Path, inputs: Path) -> dict:
    """An .npz of ``query`` and optionally ``key``, ``value`` and ``mask`` (as ``mhaserve infer --save`` writes
    it), checked as the server checks a request to the folder's model (shapes, the mask's form, finite values; no
    limit of size), in the served form: FP32 tensors and the rank-4 BOOL mask."""
    import zipfile

    import numpy as np

    from mhaserve.contract.model_dir import read_manifest
    from mhaserve.contract.signature import ModelSignature
    from mhaserve.server.errors import RequestError
    from mhaserve.server.tensors import Limits, checked_inputs

    try:
        saved = np.load(inputs)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
        raise UsageError(f"--inputs {inputs}: not a readable .npz ({error or type(error).__name__})") from None
    if not isinstance(saved, np.lib.npyio.NpzFile):
        raise UsageError(f"--inputs {inputs}: one array, not an .npz of named arrays (query, key, value, mask)")
    with saved:
        arrays = {name: saved[name] for name in ("query", "key", "value", "mask") if name in saved}
    if "query" not in arrays:
        raise UsageError(f"--inputs {inputs}: holds no 'query' array (it has {', '.join(arrays) or 'none'})")
    arrays = {name: array.astype(np.float32) if name != "mask" else array for name, array in arrays.items()}
    manifest = read_manifest(model_dir)
    config = manifest["config"]
    signature = ModelSignature(
        model_dir.name, "", config["d_model"], config["num_heads"], manifest.get("precision", "fp32")
    )
    try:
        run = checked_inputs(arrays, (), signature, Limits(*(3 * [np.iinfo(np.int64).max])))
    except RequestError as refused:
        raise UsageError(f"--inputs {inputs}: {refused.message}") from None
    return {"query": run.query, "key": run.key, "value": run.value, "mask": np.ascontiguousarray(run.mask)}


def _run_validate(args) -> int:
    from mhaserve.contract.model_dir import manifest_missing

    for flag, folder in (("--model-dir", args.model_dir), ("--against", args.against)):
        if folder is not None and (problem := manifest_missing(folder)):
            raise UsageError(f"{flag} {problem}")
    require_extra("export", "mhaserve validate")  # it runs eager PyTorch beside the export
    from mhaserve.export.writer import check_on_inputs, revalidate_model_dir

    if args.inputs is not None:
        feeds = _checked_inputs(args.model_dir, args.inputs)
        return 0 if check_on_inputs(args.model_dir, feeds, str(args.inputs), args.against) else 1
    if args.against is not None:
        raise UsageError("--against compares answers on --inputs; there is no --inputs")
    return 0 if revalidate_model_dir(args.model_dir, seed=args.seed) else 1
