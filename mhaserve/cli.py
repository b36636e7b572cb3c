"""The ``mhaserve`` command: export, validate, serve, infer.

Each subcommand imports what it needs when it runs, so ``serve`` and ``infer`` never load torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export the MHA module to a validated ONNX model folder")
    p.add_argument("--out", type=Path, default=Path("model_repository/mha"), help="model folder to write")
    p.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    p.add_argument("--heads", type=int, default=8, help="number of heads; must divide d-model (default 8)")
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--seed", type=int, default=0, help="seed of the default initialisation (default 0)")
    weights.add_argument(
        "--weights", type=Path, help="weights file written by mhaserve (overrides sizes and seed)"
    )
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 17)")
    p.add_argument("--name", default="mha", help="model name the server registers (default mha)")
    p.add_argument(
        "--validation-seed", type=int, default=None, help="seed of the validation inputs (default random)"
    )
    p.set_defaults(run=_run_export)


def _run_export(args) -> int:
    from mhaserve.export.model_dir import export_model_dir
    from mhaserve.export.onnx_export import DEFAULT_OPSET
    from mhaserve.model import load_weights, seeded_module

    if args.weights:
        module = load_weights(args.weights)
        source = {"weights": str(args.weights)}
    else:
        module = seeded_module(args.d_model, args.heads, args.seed)
        source = {"seed": args.seed}
    print(
        f"exporting MHA d_model={module.d_model} heads={module.num_heads} to {args.out} "
        f"and validating it against eager PyTorch",
        file=sys.stderr,
    )
    manifest = export_model_dir(
        module,
        args.out,
        opset=args.opset or DEFAULT_OPSET,
        source=source,
        name=args.name,
        validation_seed=args.validation_seed,
    )
    verdict = "valid" if manifest["valid"] else "NOT valid (validation failed)"
    print(f"wrote {args.out} in {manifest['export_seconds']} s: {verdict}", file=sys.stderr)
    return 0 if manifest["valid"] else 1


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="re-run the validation matrix on an exported model folder")
    p.add_argument("model_dir", type=Path)
    p.add_argument("--seed", type=int, default=None, help="seed of the validation inputs (default random)")
    p.set_defaults(run=_run_validate)


def _run_validate(args) -> int:
    from mhaserve.export.model_dir import revalidate_model_dir

    return 0 if revalidate_model_dir(args.model_dir, seed=args.seed) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhaserve", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_export(sub)
    _add_validate(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
