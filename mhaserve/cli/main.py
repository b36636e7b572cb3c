"""The ``mhaserve`` command: export, validate, serve, infer, bench, health, ray-deploy.

Each subcommand imports what it needs when it runs, so ``serve`` and ``infer`` never load torch.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

from mhaserve.contract.errors import UsageError
from mhaserve.contract.signature import PRECISIONS

# What each optional part needs, checked before a command starts its work: (modules, what they are).
EXTRAS = {
    "export": (("torch", "onnx", "onnxscript"), "torch and onnx"),
    "plot": (("matplotlib",), "matplotlib"),
}


def require_extra(extra: str, for_what: str) -> None:
    """A missing extra is one line naming the install command (in a clone, and for an installed package)."""
    import importlib.util

    modules, what = EXTRAS[extra]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(
            f"{for_what} needs the '{extra}' extra ({what}; {', '.join(missing)} not installed): in a clone, "
            f".venv/bin/pip install -e '.[{extra}]'; else pip install 'mhaserve[{extra}]'"
        )


def _add_export(sub) -> None:
    p = sub.add_parser("export", help="export the MHA module to a validated ONNX model folder")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--out", type=Path, default=None, help="model folder to write (default model_repository/mha)")
    where.add_argument("--repository", type=Path, help="write the next version of --name into this model repository "
                       "(DIR/NAME/<n+1>/); a server polling it picks the version up")  # fmt: skip
    p.add_argument("--d-model", type=int, default=None, help="model width of the seeded module (default 512)")
    p.add_argument("--heads", type=int, default=None, help="number of heads; must divide d-model (default 8; "
                   "with --weights, required unless the file says)")  # fmt: skip
    weights = p.add_mutually_exclusive_group()
    weights.add_argument("--seed", type=int, default=0, help="seed of the default initialisation (default 0)")
    weights.add_argument("--weights", type=Path, help="trained weights: a state dict (.pt/.pth/.bin/.safetensors) of "
                         "a module with W_q..W_o or w_q..w_o, nn.MultiheadAttention, a BERT-style encoder, or "
                         "mhaserve's own file")  # fmt: skip
    p.add_argument("--prefix", help="the key prefix of one attention layer in --weights (e.g. encoder.layers.3.)")
    p.add_argument("--trust-module", action="store_true", help="with --weights of a whole saved module "
                   "(torch.save(model)): also load it as torch.load does, running the code it was saved with (only "
                   "for a file you trust; its classes must be importable), and validate the export against its own "
                   "answers instead of against its weights in mhaserve's module")  # fmt: skip
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default 18)")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32", help="what the graph computes in; fp16 "
                   "takes and returns float32 but returns the attention weights in float16; int8 computes the four "
                   "projections in int8, validated within its own tolerance (default fp32)")  # fmt: skip
    p.add_argument("--name", default="mha", help="model name the server registers; with --repository, the model's "
                   "folder (default mha)")  # fmt: skip
    p.add_argument("--validation-seed", type=int, default=None, help="seed of the validation inputs (default random)")
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
        row = line.removeprefix("output-only graph: ").removeprefix("step graph: ").startswith("[")
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
    require_extra("export", "mhaserve export")

    from mhaserve.export.onnx_export import DEFAULT_OPSET
    from mhaserve.export.writer import export_identity, export_model_dir
    from mhaserve.model import DEFAULT_D_MODEL, DEFAULT_NUM_HEADS, load_checkpoint, seeded_module

    if args.weights:
        module, source = load_checkpoint(args.weights, args.heads, args.prefix)
        if args.d_model is not None and args.d_model != module.d_model:
            raise UsageError(f"--d-model {args.d_model}, but {args.weights} holds d_model {module.d_model}")
        saved = f" (a saved {source['module_class']})" if "module_class" in source else ""
        print(f"read {source['layout']} weights at prefix {source['prefix']!r} from {args.weights}{saved}: "
              f"d_model {module.d_model} (from the shapes), {module.num_heads} heads (from {source['heads_from']})",
              file=sys.stderr)  # fmt: skip
        reference = None
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
        reference = None
        try:
            module = seeded_module(args.d_model or DEFAULT_D_MODEL, args.heads or DEFAULT_NUM_HEADS, args.seed)
        except ValueError as error:  # sizes that do not fit: the module's own message says how
            raise UsageError(str(error)) from None
        source = {"kind": "seed", "seed": args.seed}
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
        _write_triton_repo(args)
    return 0 if manifest["valid"] else 1


def _write_triton_repo(args) -> None:
    """With --triton-repo, the valid folder --out as a Triton model too."""
    if args.triton_repo:
        from mhaserve.export.triton_repo import write_triton_repo

        print(f"wrote Triton model {write_triton_repo(args.out, args.triton_repo)}", file=sys.stderr)


def _add_validate(sub) -> None:
    p = sub.add_parser("validate", help="re-run the validation matrix on an exported model folder")
    p.add_argument("model_dir", type=Path, help="the model folder 'mhaserve export' wrote")
    p.add_argument("--seed", type=int, default=None, help="seed of the validation inputs (default random)")
    p.add_argument("--inputs", type=Path, help="instead, compare the folder's answers on your own inputs (an .npz "
                   "with query and optionally key, value, mask, as 'mhaserve infer --save' writes) against float32's, "
                   "within the folder's precision's tolerance")  # fmt: skip
    p.add_argument("--against", type=Path, help="with --inputs: a float32 folder of the same weights to compare "
                   "against (default: eager float32 PyTorch on the folder's own weights)")  # fmt: skip
    p.set_defaults(run=_run_validate)


def _run_validate(args) -> int:
    if not (args.model_dir / "manifest.json").is_file():
        what = "no such folder" if not args.model_dir.exists() else "no manifest.json in it"
        raise UsageError(f"{args.model_dir}: {what}; give a folder 'mhaserve export' wrote")
    require_extra("export", "mhaserve validate")  # it runs eager PyTorch beside the export
    from mhaserve.export.writer import check_on_inputs, revalidate_model_dir

    if args.inputs is not None:
        return 0 if check_on_inputs(args.model_dir, args.inputs, args.against) else 1
    if args.against is not None:
        raise UsageError("--against compares answers on --inputs; there is no --inputs")
    return 0 if revalidate_model_dir(args.model_dir, seed=args.seed) else 1


def _add_serve(sub) -> None:
    from mhaserve.server.config import add_server_arguments

    p = sub.add_parser(
        "serve", help="serve a model folder over gRPC and HTTP/REST (default: the embedded default model)"
    )
    add_server_arguments(p)
    p.set_defaults(run=_run_serve)


def _run_serve(args) -> int:
    from mhaserve.server.app import run
    from mhaserve.server.config import settings_from_args

    settings = settings_from_args(args)
    from mhaserve.server.ports import busy_port_message

    if (busy := busy_port_message(settings)) is not None:  # before a first run's export, not after it
        raise UsageError(busy)
    if settings.model_repository:
        return run(settings, None)
    from mhaserve.export.default_model import default_model_ready, ensure_default_model

    if settings.model_dir is None and not default_model_ready():
        require_extra("export", "the first run's export of the default model")

    return run(settings, settings.model_dir or ensure_default_model())


def _add_connection_arguments(p) -> None:
    """Where the server is and how to reach it: the same flags for every command that calls one."""
    p.add_argument("--url", default=None, help="server address host:port (default 127.0.0.1:8001, with --protocol "
                   "http 127.0.0.1:8000)")  # fmt: skip
    p.add_argument("--tls", action="store_true", help="connect with TLS, checking the server against the system's "
                   "CA roots (implied by --tls-ca)")  # fmt: skip
    p.add_argument("--tls-ca", type=Path, help="PEM CA bundle that signed the server's certificate (turns TLS on)")
    p.add_argument("--tls-cert", type=Path, help="PEM client certificate, for a server with mutual TLS")
    p.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    p.add_argument("--tls-server-name", help="name to check the server's certificate against (default: the URL's host)")
    p.add_argument("--token-file", type=Path, help="file holding the bearer token (default: $MHASERVE_TOKEN if set)")


def _add_protocol_argument(p) -> None:
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                   help="gRPC, or the same protocol over HTTP/REST (default grpc)")  # fmt: skip
    p.add_argument("--application", default=None, help="Ray Serve application to call through Ray's gRPC proxy "
                   "('mhaserve ray-deploy --name'; sent as 'application' metadata)")  # fmt: skip


def _client(args, tls, token):
    """The gRPC or HTTP client the flags ask for (the same calls)."""
    if args.protocol == "http":
        from mhaserve.client.http import HttpClient

        if args.application:
            raise UsageError("--application names a Ray Serve application behind Ray's gRPC proxy: use --protocol grpc")

        return HttpClient(args.url, args.model, tls=tls, token=token, version=args.version)
    from mhaserve.client.grpc import Client

    return Client(args.url, args.model, tls=tls, token=token, version=args.version, application=args.application)


def _failure(error, args=None) -> str:
    """A refused call as STATUS: message, whichever protocol carried it; a port of the other protocol said so."""
    message = f"{error.status_name}: {error.message}"
    protocol = getattr(args, "protocol", "grpc")
    if protocol == "http" and "BadStatusLine" in error.message:  # an HTTP/1.1 client at a gRPC (HTTP/2) port
        return f"{args.url} speaks gRPC, not HTTP/REST: drop --protocol http, or give the HTTP port (default 8000)"
    if protocol == "grpc" and ("http1.x server" in error.message or "Expected SETTINGS frame" in error.message):
        return f"{args.url} speaks HTTP/REST, not gRPC: add --protocol http, or give the gRPC port (default 8001)"
    return message


def _connection(args):
    """(TLS or None, token or None) from the connection flags."""
    from mhaserve.client import TLS, read_token

    if args.url is None:
        args.url = "127.0.0.1:8000" if getattr(args, "protocol", "grpc") == "http" else "127.0.0.1:8001"

    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        if (args.tls_cert is None) != (args.tls_key is None):
            raise SystemExit("--tls-cert and --tls-key go together")
        tls = TLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    try:
        return tls, read_token(args.token_file)
    except OSError as error:
        raise SystemExit(f"cannot read --token-file {args.token_file}: {error.strerror}") from None


def _model_width(client, args, timeout: float) -> int | None:
    """The served model's d_model from its metadata; None, with the reason on stderr, when it cannot be had."""

    from mhaserve.client import RequestFailed

    try:
        return client.model_width(timeout=timeout)
    except RequestFailed as error:
        print(f"cannot reach model '{args.model}' at {args.url}: {_failure(error, args)}", file=sys.stderr)
        return None


def _infer_steps(client, arrays: dict, args) -> int:
    """The query's rows, ``args.steps`` a step, as a sequence: each step's newest row's strongest keys, head 0."""
    import time

    from mhaserve.client import RequestFailed, WeightsOptions

    if set(arrays) != {"query"} or args.shared_memory == "system":
        raise UsageError("--steps sends the query alone (a step's rows are its new keys and values), over the socket")
    query, top = arrays["query"], args.top_k or 3
    with client.sequence() as sequence:
        for start in range(0, query.shape[1], args.steps):
            rows = query[:, start : start + args.steps]
            end = start + rows.shape[1] >= query.shape[1]
            started = time.perf_counter()
            try:
                result = sequence.step(rows, weights=WeightsOptions(top_k=min(top, start + rows.shape[1])), end=end,
                                       timeout=args.timeout)  # fmt: skip
            except RequestFailed as error:
                print(_failure(error, args), file=sys.stderr)
                return 1
            values, keys = result.top_k
            newest = ", ".join(f"{k} ({v:.2f})" for k, v in zip(keys[0, 0, -1], values[0, 0, -1], strict=True))
            print(f"rows {start}..{start + rows.shape[1] - 1}: {(time.perf_counter() - started) * 1000:7.3f} ms; "
                  f"row {start + rows.shape[1] - 1} attends most to keys {newest} (head 0)")  # fmt: skip
    return 0


def _add_weights_arguments(p) -> None:
    """What a request asks of the attention weights: the server's attn_* request parameters."""
    p.add_argument("--heads", type=_int_list, default=None, help="only these heads' weights, e.g. 0,3")
    p.add_argument("--rows", default=None, help="only these query rows, a start:stop range, e.g. 0:32")
    p.add_argument("--keys", default=None, help="only these key positions, a start:stop range")
    ranked = p.add_mutually_exclusive_group()
    ranked.add_argument("--top-k", type=int, default=None, help="the k highest-weighted keys of each query row "
                        "(values and key positions)")  # fmt: skip
    ranked.add_argument("--top-p", type=float, default=None, help="each row's fewest keys holding this fraction "
                        "of its weight")  # fmt: skip
    p.add_argument("--weights-precision", choices=("fp32", "fp16"), default=None,
                   help="the weights' datatype (fp16: half the bytes; default: the model's)")  # fmt: skip


def _weights_options(args):
    from mhaserve.client import WeightsOptions

    options = WeightsOptions(args.heads, args.rows, args.keys, args.top_k, args.top_p, args.weights_precision)
    return options if options.parameters() else None


def _add_infer(sub) -> None:
    p = sub.add_parser("infer", help="call a server with random or .npy inputs; print shapes and latency")
    _add_connection_arguments(p)
    _add_protocol_argument(p)
    p.add_argument("--model", default="mha", help="model name (default mha)")
    p.add_argument("--version", default="", help="model version (default: the newest ready one)")
    p.add_argument("--batch", type=int, default=1, help="batch of the random inputs")
    p.add_argument("--q-len", type=int, default=16, help="query length of the random inputs")
    p.add_argument("--kv-len", type=int, default=None, help="key/value length: cross-attention (default self)")
    for name in ("query", "key", "value", "mask"):
        p.add_argument(f"--{name}", type=Path, help=f"{name} from a .npy file")
    p.add_argument("--no-weights", action="store_true", help="do not ask for every head's attn_weights")
    p.add_argument("--mean-weights", action="store_true", help="ask for attn_weights_mean [B, Lq, Lk], the weights "
                   "averaged over heads (h times fewer bytes)")  # fmt: skip
    p.add_argument("--repeat", type=int, default=1, help="calls to time (default 1)")
    p.add_argument("--steps", type=int, default=0, metavar="N", help="a sequence instead: the query's rows sent one "
                   "step at a time (N rows a step) to a sequence kept on the server, printing each step's newest row's "
                   "strongest keys (--top-k of them, default 3) as it goes")  # fmt: skip
    p.add_argument("--timeout", type=float, default=30.0, help="deadline per call, seconds")
    _add_shared_memory_argument(p)
    p.add_argument("--save", type=Path, help="write inputs and outputs to this .npz")
    p.add_argument("--heatmap", type=Path, help="draw one item's attention weights to this .png (needs the plot extra)")
    p.add_argument("--head", type=_head, default=None, help="head for --heatmap, or 'mean' for the mean over "
                   "heads (default: the first head asked for)")  # fmt: skip
    p.add_argument("--item", type=int, default=0, help="batch item for --heatmap (default 0)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    _add_weights_arguments(p)
    p.set_defaults(run=_run_infer)


def _add_shared_memory_argument(parser) -> None:
    parser.add_argument(
        "--shared-memory", choices=("none", "system"), default="none",
        help="system: send the tensors through POSIX shared memory (a server on this host, run with "
        "--allow-client-shm true); none (default): through the socket",
    )  # fmt: skip


def _head(text: str) -> int | str:
    if text == "mean":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a head number or 'mean', got {text!r}") from None


def _load_array(name: str, path: Path):
    """One .npy array for --query/--key/--value/--mask, or a one-line usage error."""
    import numpy as np

    try:
        array = np.load(path)
    except (OSError, ValueError, EOFError) as error:
        raise UsageError(f"--{name} {path}: not a readable .npy ({error or type(error).__name__})") from None
    if not isinstance(array, np.ndarray):
        raise UsageError(f"--{name} {path}: an .npz of several arrays; pass one .npy per input")
    return array


def _run_infer(args) -> int:
    import time

    import numpy as np

    from mhaserve.client import RequestFailed

    weights = _weights_options(args)
    ranked = weights is not None and weights.ranked
    # A heatmap of the mean needs only the mean; one of a head needs the heads' weights, or their top keys.
    mean_weights = args.mean_weights or (args.heatmap is not None and args.head == "mean")
    all_weights = not args.no_weights or (args.heatmap is not None and args.head != "mean" and not ranked)
    tls, token = _connection(args)
    with _client(args, tls, token) as client:
        d_model = _model_width(client, args, timeout=args.timeout)
        if d_model is None:
            return 1
        rng = np.random.default_rng(args.seed)
        arrays = {name: _load_array(name, getattr(args, name)) for name in ("query", "key", "value", "mask")
                  if getattr(args, name)}  # fmt: skip
        if "query" not in arrays:
            arrays["query"] = rng.standard_normal((args.batch, args.q_len, d_model), dtype=np.float32)
        if args.kv_len and "key" not in arrays:
            batch = arrays["query"].shape[0]
            arrays["key"] = rng.standard_normal((batch, args.kv_len, d_model), dtype=np.float32)
            arrays["value"] = rng.standard_normal((batch, args.kv_len, d_model), dtype=np.float32)
        if args.steps:
            return _infer_steps(client, arrays, args)
        latencies = []
        regions = client.shared_memory() if args.shared_memory == "system" else contextlib.nullcontext()
        try:
            with regions:
                for _ in range(max(1, args.repeat)):
                    started = time.perf_counter()
                    result = client.infer(
                        **arrays,
                        attn_weights=all_weights,
                        attn_weights_mean=mean_weights,
                        timeout=args.timeout,
                        weights=weights,
                        shared_memory=regions if args.shared_memory == "system" else None,
                    )
                    latencies.append((time.perf_counter() - started) * 1000)
        except RequestFailed as error:
            print(_failure(error), file=sys.stderr)
            return 1
    outputs = result.outputs
    shapes = ", ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in arrays.items())
    print(f"inputs: {shapes}")
    print("  ".join(f"{name}: {list(array.shape)}" for name, array in outputs.items()))
    print(f"answered by model '{args.model}' version {result.model_version}")
    lat = np.array(latencies)
    print(
        f"latency ms over {len(lat)} calls: p50 {np.percentile(lat, 50):.3f}  p90 {np.percentile(lat, 90):.3f}  "
        f"min {lat.min():.3f}  max {lat.max():.3f} (first call included)"
    )
    if args.save:
        np.savez(args.save, **arrays, **outputs)
        print(f"saved {args.save}")
    if args.heatmap:
        from mhaserve.cli.heatmap import write_heatmap

        batch = result.output.shape[0]
        if not 0 <= args.item < batch:
            raise UsageError(f"--item {args.item}: the batch has items 0..{batch - 1}")
        kv_len = arrays.get("key", arrays["query"]).shape[1]
        drawn, what = _heatmap_weights(result, args, weights, kv_len)
        write_heatmap(drawn, args.heatmap, title=f"{args.model}: item {args.item}, {what}")
        print(f"wrote {args.heatmap} (item {args.item}, {what})")
    return 0


def _heatmap_weights(result, args, options, kv_len: int):
    """The [Lq', Lk] map to draw for ``--head`` and what it shows: the head's (or the mean's) weights as asked
    for, or its top keys as a sparse map over every key position."""
    import numpy as np

    item = args.item
    if args.head == "mean":
        return result.attn_weights_mean[item], "mean over heads"
    chosen = list(options.heads) if options is not None and options.heads is not None else None
    head = args.head if args.head is not None else (chosen[0] if chosen else 0)
    if chosen is not None and head not in chosen:
        raise UsageError(f"--head {head}: the request asked for heads {','.join(map(str, chosen))} only")
    position = chosen.index(head) if chosen is not None else head
    if result.top_k is not None:
        if not 0 <= position < result.top_k[0].shape[1]:
            raise UsageError(f"--head {head}: the model has heads 0..{result.top_k[0].shape[1] - 1}")
        values, indices = (array[item, position] for array in result.top_k)
        sparse = np.zeros((values.shape[0], kv_len), np.float32)
        rows = np.arange(values.shape[0])[:, None].repeat(values.shape[1], axis=1)
        kept = indices >= 0
        sparse[rows[kept], indices[kept]] = values[kept]
        return sparse, f"head {head}, top keys"
    heads = result.attn_weights.shape[1]
    if not 0 <= position < heads:
        raise UsageError(f"--head {head}: the model has heads 0..{heads - 1} (or 'mean')")
    return result.attn_weights[item, position], f"head {head}"


def _add_health(sub) -> None:
    p = sub.add_parser("health", help="ask a server's grpc.health.v1 service; exit 0 only when SERVING")
    _add_connection_arguments(p)
    p.add_argument("--timeout", type=float, default=3.0, help="deadline of the health check, seconds")
    p.set_defaults(run=_run_health)


def _run_health(args) -> int:
    """For container healthchecks and scripts: one line, and the exit status says it."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from mhaserve.client.grpc import open_channel

    tls, _ = _connection(args)  # health needs no token
    with open_channel(args.url, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
        except grpc.RpcError as error:
            print(f"{args.url}: {error.code().name}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(f"{args.url}: {status}")
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        expected = "expected whole numbers separated by commas (e.g. 1,4,16)"
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x]
    except ValueError:
        expected = "expected numbers separated by commas (e.g. 100,200.5)"
        raise argparse.ArgumentTypeError(f"{expected}, got {text!r}") from None


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("..")
    try:
        low, high = int(low), int(high or low)
    except ValueError:
        low = high = 0  # refused below, with what it takes
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected LEN or MIN..MAX with 1 <= MIN <= MAX, got {text!r}")
    return low, high


def _check_writable(path: Path, flag: str) -> None:
    """A file the command will write at its end can be: its folder exists and takes files, and it is no folder."""
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"{flag} {path}: cannot be written (permissions)")


def _compare_runs(words: list[str]) -> int:
    """``bench compare A.json B.json [C.json ...]``: each later run against A, point by point."""
    import json

    from mhaserve.loadtest.rounds import compare

    if len(words) < 3 or words[0] != "compare":
        raise UsageError(f"bench takes 'compare A.json B.json [...]' or options only, got {' '.join(words)!r}")
    runs = []
    for path in words[1:]:
        try:
            runs.append(json.loads(Path(path).read_text()))
        except (OSError, ValueError) as error:
            raise UsageError(f"{path}: not a 'mhaserve bench --json' file ({error})") from None
        if not isinstance(runs[-1], dict) or not isinstance(runs[-1].get("points"), list):
            raise UsageError(f"{path}: not a 'mhaserve bench --json' file (no list of 'points')")
        try:  # every field compare reads, read before any line is printed
            compare(runs[-1], runs[-1])
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as error:
            what = f"{type(error).__name__}: {error}"[:200]
            raise UsageError(f"{path}: not a 'mhaserve bench --json' file (a point it holds: {what})") from None
    compared = 0
    for path, run in zip(words[2:], runs[1:], strict=True):
        lines = compare(runs[0], run)
        if not lines:
            print(f"no point of {path} was measured in {words[1]} (same mode, load, shape and outputs)")
            continue
        compared += 1
        print(f"{path} against {words[1]}, after / before:")
        for line in lines:
            print(line)
    return 0 if compared == len(runs) - 1 else 1


def _add_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="load-test a server: closed-loop concurrency sweep or open-loop rates; table, JSON/CSV, plots; "
        "'bench compare A.json B.json [...]' compares runs",
    )
    p.add_argument("compare", nargs="*", metavar="compare A.json B.json [...]",
                   help="compare runs' --json files with the first, point by point, instead of measuring")  # fmt: skip
    _add_connection_arguments(p)
    _add_protocol_argument(p)
    p.add_argument("--model", default="mha", help="model name (default mha)")
    p.add_argument("--version", default="", help="model version (default: the newest ready one)")
    load = p.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=_int_list, default=None, help="closed loop: e.g. 1,4,16,64 (default 1,4,16)"
    )
    load.add_argument("--rate", type=_float_list, default=None, help="open loop: requests/s, e.g. 100,200,400")
    p.add_argument("--batch", type=int, default=1, help="batch of each request (default 1)")
    p.add_argument("--lengths", type=_length_range, default=(16, 16), help="sequence length, or MIN..MAX drawn "
                   "uniformly per request (default 16)")  # fmt: skip
    p.add_argument("--no-weights", action="store_true", help="ask for the output only, not attn_weights")
    p.add_argument("--sequence", type=int, default=0, metavar="LENGTH", help="each caller grows sequences kept on "
                   "the server, one row a step, to LENGTH rows, then starts another: steps/s, and each step's latency "
                   "by its position (closed loop)")  # fmt: skip
    p.add_argument("--duration", type=float, default=10.0, help="measured seconds per point (default 10)")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds per point before measuring (default 2)")
    p.add_argument("--processes", type=int, default=None, help="client processes (default: cores, at most 4)")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline per request, seconds")
    p.add_argument("--rounds", type=int, default=1, help="measure each point this many times: the median round "
                   "is reported, each figure's lowest and highest beside it (default 1)")  # fmt: skip
    _add_shared_memory_argument(p)
    p.add_argument("--json", type=Path, help="write the results as JSON")
    p.add_argument("--csv", type=Path, help="write the results as CSV")
    p.add_argument("--plot-dir", type=Path, help="write latency_percentiles.png and latency_histogram.png here")
    p.add_argument("--report", type=Path, metavar="FILE.html", help="write one self-contained HTML report: the "
                   "run, the table, SLO verdicts, the server's side and the plots (needs the plot extra)")  # fmt: skip
    p.add_argument("--slo", action="append", default=[], metavar="TARGET", help="a target each point must meet, "
                   "repeatable: p50|p90|p95|p99|p99.9<TIME (ms or s), errors<N%%, throughput>N; the command exits 1 "
                   "when one is missed (a CI gate), and reports the goodput (requests a second within the latency "
                   "targets)")  # fmt: skip
    _add_weights_arguments(p)
    p.set_defaults(run=_run_bench)


def _run_bench(args) -> int:
    if args.compare:
        return _compare_runs(args.compare)
    if args.rounds < 1:
        raise UsageError(f"--rounds must be at least 1, got {args.rounds}")
    if args.sequence:
        if args.sequence < 1:
            raise UsageError(f"--sequence takes a length of at least 1 row, got {args.sequence}")
        if args.rate:
            raise UsageError("--sequence is a closed loop (each caller steps its sequences in order): give "
                             "--concurrency, not --rate")  # fmt: skip
        if args.shared_memory != "none":
            raise UsageError("--sequence sends its one-row steps over the socket; leave out --shared-memory")
        args.lengths = (1, 1)  # a step carries one new row
    from mhaserve.loadtest.slo import goodput, parse_slo, summary, summary_lines, verdicts

    try:
        slos = [parse_slo(text) for text in args.slo]
    except ValueError as error:
        raise UsageError(str(error)) from None
    for asked, flag in ((args.plot_dir, "--plot-dir"), (args.report, "--report")):
        if asked:  # before the sweep, not after it
            require_extra("plot", flag)
    for path, flag in ((args.json, "--json"), (args.csv, "--csv"), (args.report, "--report")):
        if path is not None:  # before the sweep: a path that cannot be written would lose its results
            _check_writable(path, flag)
    from mhaserve.loadtest import report
    from mhaserve.loadtest.loadgen import LoadGenerator, Point, Workload, default_processes

    tls, token = _connection(args)
    with _client(args, tls, token) as client:
        d_model = _model_width(client, args, timeout=10)
        described = _model_described(client, args) if d_model is not None else {}
    if d_model is None:
        return 1
    workload = Workload(
        d_model,
        args.batch,
        *args.lengths,
        attn_weights=not args.no_weights,
        model=args.model,
        version=args.version,
        protocol=args.protocol,
        application=args.application or "",
        weights=_weights_options(args),
        shared_memory=args.shared_memory,
        sequence_length=args.sequence,
    )
    if args.rate:
        points = [Point("open", rate, args.duration, args.warmup) for rate in args.rate]
    else:
        points = [Point("closed", c, args.duration, args.warmup) for c in (args.concurrency or [1, 4, 16])]
    processes = args.processes or default_processes()
    weights = "with attn_weights" if workload.attn_weights else "output only"
    title = f"{args.url} ({args.protocol}) {args.model} {workload.shape_text} {weights}"
    rounds = f" x {args.rounds} rounds" if args.rounds > 1 else ""
    about = len(points) * args.rounds * (args.warmup + args.duration)
    print(f"mhaserve bench: {title}; {len(points)} points{rounds} x ({args.warmup:g} s warm-up + {args.duration:g} "
          f"s): about {about:g} s, up to {processes} client processes", file=sys.stderr)  # fmt: skip
    results = []
    print(report.table_header())
    judged = []  # per point: its SLO verdicts and goodput
    from mhaserve.loadtest.rounds import of_rounds, rounds_line
    from mhaserve.loadtest.server_side import counters_of

    statistics_client = _client(args, tls, token)  # the server's side of each point: its statistics, read twice
    with (
        statistics_client,
        LoadGenerator(
            args.url, processes, args.timeout, tls=tls, token=token, counters=counters_of(statistics_client)
        ) as generator,
    ):
        for i, point in enumerate(points, 1):
            print(f"[{i}/{len(points)}] {point.label} ...", file=sys.stderr, flush=True)
            rounds = [generator.measure(workload, point) for _ in range(args.rounds)]
            results.append(of_rounds(rounds) if args.rounds > 1 else rounds[0])
            print(report.table_row(results[-1]), flush=True)
            judged.append({"slo": verdicts(results[-1], slos), "goodput_per_s": goodput(results[-1], slos)})
    for line in report.notes(results):
        print(line)
    for result in results if args.rounds > 1 else ():
        print(rounds_line(result))
    missed = []
    for result, verdict in zip(results, judged, strict=True):
        if slos:
            held = ", ".join(
                f"{v['slo']} {'held' if v['held'] else 'MISSED'} ({v['observed']})" for v in verdict["slo"]
            )
            good = f"; goodput {verdict['goodput_per_s']:.1f}/s" if verdict["goodput_per_s"] is not None else ""
            print(f"{result.point.label}: {held}{good}")
        missed += [f"{v['slo']} at {result.point.label} ({v['observed']})" for v in verdict["slo"] if not v["held"]]
    meta = {"url": args.url, "model": args.model, "processes": processes, "title": title, "slo": args.slo,
            **report.run_metadata(sys.argv, described)}  # fmt: skip
    if args.json:
        report.write_json(results, args.json, meta, judged)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.csv:
        report.write_csv(results, args.csv)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.plot_dir:
        for path in report.plot(results, args.plot_dir, title, slos):
            print(f"wrote {path}", file=sys.stderr)
    if args.report:
        report.write_html(results, args.report, meta, judged, title, slos)
        print(f"wrote {args.report}", file=sys.stderr)
    for line in summary_lines(summary(results, slos)) if slos else ():
        print(line)
    if missed:
        print(f"SLO missed: {'; '.join(missed)}")
        return 1
    if slos:
        print(f"SLO held at every point: {', '.join(args.slo)}")
    return 0


def _model_described(client, args) -> dict:
    """The model as the server describes it (name, versions, platform, precision) and how the server runs it (its
    provider and settings, from the model's configuration), for the run's record."""
    from google.protobuf import json_format

    from mhaserve.client import RequestFailed

    try:
        metadata, config = client.metadata(timeout=10), client.config(timeout=10)
    except RequestFailed:
        return {"name": args.model}
    if not isinstance(metadata, dict):  # gRPC's messages
        metadata = json_format.MessageToDict(metadata, preserving_proto_field_name=True)
        config = json_format.MessageToDict(config, preserving_proto_field_name=True)
    parameters = {name: p.get("string_value", "") for name, p in config.get("parameters", {}).items()}
    described = {key: metadata[key] for key in ("name", "versions", "platform") if key in metadata}
    described["precision"] = parameters.pop("precision", None)
    for shape in ("d_model", "num_heads", "computes_in"):
        parameters.pop(shape, None)
    provider = {"provider": parameters.pop("provider")} if "provider" in parameters else {}
    return {**described, "served_with": {**provider, **dict(sorted(parameters.items()))}}


def _add_ray_deploy(sub) -> None:
    p = sub.add_parser(
        "ray-deploy",
        help="deploy a model folder on a Ray cluster as a Ray Serve application (OIP over Ray's gRPC proxy)",
    )
    p.add_argument("model_dir", type=Path, help="model folder written by 'mhaserve export', at this path on every node")
    p.add_argument("--address", default="auto", help="the cluster's address, as 'ray start' printed it (default: auto)")
    p.add_argument("--name", default="mha", help="application and model name; clients send it as 'application' "
                   "metadata (default mha)")  # fmt: skip
    p.add_argument("--min-replicas", type=int, default=1, help="replicas kept however idle (default 1)")
    p.add_argument("--max-replicas", type=int, default=2, help="replicas at most, added on load (default 2)")
    p.add_argument("--target-ongoing-requests", type=float, default=8,
                   help="requests in progress per replica that autoscaling aims at (default 8)")  # fmt: skip
    p.add_argument("--replica-cpus", type=float, default=1, help="CPUs each replica reserves; ONNX Runtime runs as "
                   "many threads (default 1)")  # fmt: skip
    p.add_argument("--max-replicas-per-node", type=int, default=None, help="spread replicas over at least "
                   "replicas/N nodes (default: Ray's spread, no bound)")  # fmt: skip
    p.add_argument("--grpc-port", type=int, default=9000, help="the proxies' gRPC port (default 9000)")
    p.add_argument("--http-port", type=int, default=8000, help="the proxies' HTTP port (default 8000)")
    p.add_argument("--proxy-location", choices=("EveryNode", "HeadOnly"), default="EveryNode",
                   help="a proxy on every node with a replica, or on the head only (default EveryNode)")  # fmt: skip
    p.set_defaults(run=_run_ray_deploy)


def _reachable(address: str, timeout_s: float = 5.0) -> bool:
    """Whether something listens at HOST:PORT (ray.init would wait for minutes on a wrong address)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _run_ray_deploy(args) -> int:
    from mhaserve.contract.model_dir import ModelDirError, read_manifest

    try:
        read_manifest(args.model_dir)
    except (ModelDirError, ValueError) as error:
        raise UsageError(f"{args.model_dir}: {error}") from None
    if not 1 <= args.min_replicas <= args.max_replicas:
        raise UsageError(f"need 1 <= --min-replicas <= --max-replicas, got {args.min_replicas} and {args.max_replicas}")
    if args.address != "auto" and not _reachable(args.address):
        raise UsageError(f"no Ray cluster answers at --address {args.address} (start one with 'ray start --head')")
    try:
        from mhaserve.server.ray.deployment import deploy
    except ImportError as error:
        raise UsageError(f"ray-deploy needs Ray Serve: pip install 'mhaserve[ray]' ({error})") from None
    try:
        name = deploy(
            args.model_dir,
            address=args.address,
            name=args.name,
            grpc_port=args.grpc_port,
            http_port=args.http_port,
            proxy_location=args.proxy_location,
            min_replicas=args.min_replicas,
            max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests,
            replica_cpus=args.replica_cpus,
            max_replicas_per_node=args.max_replicas_per_node,
        )
    except ConnectionError as error:
        raise UsageError(f"no Ray cluster at --address {args.address}: {error}") from None
    except Exception as error:  # Ray's own failure (a replica that cannot start, a port taken): one line
        message = str(error).strip().splitlines()
        print(f"mhaserve ray-deploy: deploying failed: {type(error).__name__}: {message[-1] if message else ''}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"application '{name}' serves the Open Inference Protocol on the proxies' gRPC port {args.grpc_port}; "
          f"send metadata 'application: {name}' (mhaserve infer/bench --application {name})")  # fmt: skip
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusal is its one line and where to look, not the whole usage first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(the flags: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mhaserve", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    _add_export(sub)
    _add_validate(sub)
    _add_serve(sub)
    _add_infer(sub)
    _add_bench(sub)
    _add_health(sub)
    _add_ray_deploy(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as error:  # the user's input: one line, exit code 2, as argparse does
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _stopped(signum, frame):
    os.write(2, b"mhaserve: stopped (SIGTERM)\n")
    os._exit(128 + signum)  # as the signal's default action would end it: at once, wherever it is


def process_main() -> int:
    """The ``mhaserve`` process: ``main``, ended by SIGTERM from its first line on as the signal's default action
    ends a process. In a container the command is process 1, to which the kernel delivers no signal it has no
    handler for: a stop during the start (the imports, the first run's export) would otherwise wait out the
    engine's whole grace period, then kill. (Raising an exception from the handler instead was not enough: one
    that lands inside a C extension's import is turned into an ImportError, or lost.) The server takes SIGTERM
    over at its bind: from there it stops its load, or drains."""
    signal.signal(signal.SIGTERM, _stopped)
    return main()
