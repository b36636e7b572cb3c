"""What several commands share: the extras they need, how they reach a server (address, TLS, token, protocol),
what a request asks of the attention weights, and the argument types."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from pathlib import Path

from mhaserve.contract.errors import UsageError

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


def bounded(convert, low: float, *, above: bool = False, high: float | None = None):
    """An argument type for a number in a range (at least ``low``, or more than it with ``above``; at most ``high``
    where given), finite: argparse refuses anything else in one line, before the command does anything."""
    kind = "a whole number" if convert is int else "a number"
    if high is not None:
        limits = f"more than {low:g} and at most {high:g}" if above else f"from {low:g} to {high:g}"
    else:
        limits = f"more than {low:g}" if above else "of 0 or more" if low == 0 else f"of at least {low:g}"

    def parse(text: str):
        try:
            value = convert(text)
        except ValueError:
            value = None
        in_range = value is not None and math.isfinite(value) and (value > low if above else value >= low)
        if not in_range or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {kind} {limits}, got {text!r}")
        return value

    return parse


count = bounded(int, 1)  # how many of a thing: calls, rows, processes, heads
index = bounded(int, 0)  # a position or a seed, from 0
positive = bounded(float, 0, above=True)  # a rate, a share of CPUs
seconds = bounded(float, 0, above=True)  # a deadline, a duration
seconds_or_zero = bounded(float, 0)
share = bounded(float, 0, above=True, high=1)  # a fraction of a whole, more than none of it
port = bounded(int, 1, high=65535)


def _comma_list(element, example: str):
    """An argument type for numbers separated by commas, each read by ``element`` (a ``bounded`` type), refusing
    the whole with what it takes (argparse would otherwise name the function: "invalid _comma_list value")."""

    def parse(text: str) -> list:
        try:
            values = [element(x) for x in text.split(",") if x]
        except argparse.ArgumentTypeError:
            values = []
        if not values:
            raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}")
        return values

    return parse


def window(text: str) -> str:
    """An argument type for a start:stop range of rows or keys: its form checked here (the server, which knows the
    lengths, checks that it fits them)."""
    from mhaserve.contract.signature import window_ends

    try:
        window_ends(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


head_list = _comma_list(index, "head numbers from 0 separated by commas (e.g. 0,3)")
count_list = _comma_list(count, "whole numbers of at least 1 separated by commas (e.g. 1,4,16)")
rate_list = _comma_list(positive, "numbers more than 0 separated by commas (e.g. 100,200.5)")


def add_model_dir(p, help: str, required: bool) -> None:
    """The model folder as every command names it: ``--model-dir DIR``, serve's flag (and MHASERVE_MODEL_DIR). The
    folder given alone, as validate, tune and ray-deploy first took it, is still read (main.py merges the two)."""
    p.add_argument("--model-dir", type=Path, default=None, help=help)
    p.add_argument("model_dir_alone", nargs="?", type=Path, default=None, help=argparse.SUPPRESS)
    p.set_defaults(model_dir_required=required)


def merge_model_dir(args) -> str | None:
    """``args.model_dir`` from either spelling; what is wrong with them, or None."""
    if "model_dir_alone" not in vars(args):  # a command that takes no folder, or names it as serve does
        return None
    alone = vars(args).pop("model_dir_alone", None)
    required = vars(args).pop("model_dir_required", False)
    if alone is not None and args.model_dir is not None and alone != args.model_dir:
        return f"the model folder given twice: {alone} and --model-dir {args.model_dir}"
    args.model_dir = args.model_dir or alone
    if required and args.model_dir is None:
        return "give the model folder: --model-dir DIR"
    return None


def add_connection_arguments(p) -> None:
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


def add_protocol_argument(p) -> None:
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                   help="gRPC, or the same protocol over HTTP/REST (default grpc)")  # fmt: skip
    p.add_argument("--application", default=None, help="Ray Serve application to call through Ray's gRPC proxy "
                   "('mhaserve ray-deploy --name'; sent as 'application' metadata)")  # fmt: skip


def make_client(args, tls, token):
    """The gRPC or HTTP client the flags ask for (the same calls)."""
    if args.protocol == "http":
        from mhaserve.client.http import HttpClient

        if args.application:
            raise UsageError("--application names a Ray Serve application behind Ray's gRPC proxy: use --protocol grpc")

        return HttpClient(args.url, args.model, tls=tls, token=token, version=args.version)
    from mhaserve.client.grpc import Client

    return Client(args.url, args.model, tls=tls, token=token, version=args.version, application=args.application)


def failure_message(error, args=None) -> str:
    """A refused call as STATUS: message, whichever protocol carried it (the clients lead a call that could not be
    made with what to do: a port of the other protocol, nothing listening there)."""
    return f"{error.status_name}: {error.message}"


def connection_of(args):
    """(TLS or None, token or None) from the connection flags."""
    from mhaserve.client import TLS, read_token
    from mhaserve.client.servers import address_of

    if args.url is None:
        args.url = "127.0.0.1:8000" if getattr(args, "protocol", "grpc") == "http" else "127.0.0.1:8001"
    try:
        address_of(args.url)
    except ValueError as error:
        raise UsageError(f"--url: {error}") from None

    tls = None
    if args.tls or args.tls_ca or args.tls_cert or args.tls_key:
        if (args.tls_cert is None) != (args.tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together")
        for flag, path in (("--tls-ca", args.tls_ca), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key)):
            _readable(path, flag)
        tls = TLS(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    try:
        return tls, read_token(args.token_file)
    except OSError as error:
        raise UsageError(f"cannot read --token-file {args.token_file}: {error.strerror}") from None


def _readable(path: Path | None, flag: str) -> None:
    """A file a flag names can be read, or the command's one line says why (the TLS files, which the client reads
    only when it connects)."""
    if path is not None:
        try:
            with open(path, "rb"):
                pass
        except OSError as error:
            raise UsageError(f"cannot read {flag} {path}: {error.strerror}") from None


def model_width(client, args, timeout: float) -> int | None:
    """The served model's d_model from its metadata; None, with the reason on stderr, when it cannot be had."""

    from mhaserve.client import RequestFailed

    try:
        return client.model_width(timeout=timeout)
    except RequestFailed as error:
        print(f"cannot reach model '{args.model}' at {args.url}: {failure_message(error, args)}", file=sys.stderr)
        return None


def add_weights_arguments(p) -> None:
    """What a request asks of the attention weights: the server's attn_* request parameters."""
    p.add_argument("--heads", type=head_list, default=None, help="only these heads' weights, e.g. 0,3")
    p.add_argument("--rows", type=window, default=None, help="only these query rows, a start:stop range, e.g. 0:32")
    p.add_argument("--keys", type=window, default=None, help="only these key positions, a start:stop range (a "
                   "negative end counts from the last key; write it with '=': --keys=-8:)")  # fmt: skip
    ranked = p.add_mutually_exclusive_group()
    ranked.add_argument("--top-k", type=count, default=None, help="the k highest-weighted keys of each query row "
                        "(values and key positions)")  # fmt: skip
    ranked.add_argument("--top-p", type=share, default=None, help="each row's fewest keys holding this fraction "
                        "of its weight")  # fmt: skip
    p.add_argument("--weights-precision", choices=("fp32", "fp16"), default=None,
                   help="the weights' datatype (fp16: half the bytes; default: the model's)")  # fmt: skip
    p.add_argument("--summaries", action="store_true", help="each head's query rows summarised over every key: the "
                   "entropy of its weights, its weight on the first key, its largest weight and that key")  # fmt: skip


def weights_options(args):
    from mhaserve.client import WeightsOptions

    options = WeightsOptions(args.heads, args.rows, args.keys, args.top_k, args.top_p, args.weights_precision,
                             args.summaries)  # fmt: skip
    return options if options.parameters() or options.summaries else None


def add_shared_memory_argument(parser) -> None:
    parser.add_argument(
        "--shared-memory", choices=("none", "system"), default="none",
        help="system: send the tensors through POSIX shared memory (a server on this host, run with "
        "--allow-client-shm true); none (default): through the socket",
    )  # fmt: skip


def add_priority_argument(p) -> None:
    p.add_argument("--priority", type=index, default=0, metavar="LEVEL", help="the priority level each request asks "
                   "for (Triton's 'priority' parameter, 1 first, where the model has --priority-levels; default 0: "
                   "the model's default level)")  # fmt: skip


def add_request_arguments(p) -> None:
    """What each request of a load looks like (bench and tune): its batch, its lengths, whether it asks for the
    attention weights."""
    p.add_argument("--batch", type=count, default=1, help="batch of each request (default 1)")
    p.add_argument("--lengths", type=length_range, default=(16, 16), help="sequence length, or MIN..MAX drawn "
                   "uniformly per request (default 16)")  # fmt: skip
    p.add_argument("--no-weights", action="store_true", help="ask for the output only, not attn_weights")


def add_point_arguments(p, duration_s: float, warmup_s: float) -> None:
    """How long each load point runs, and from how many client processes (bench and tune)."""
    p.add_argument("--duration", type=seconds, default=duration_s, help=f"measured seconds per point (default "
                   f"{duration_s:g})")  # fmt: skip
    p.add_argument("--warmup", type=seconds_or_zero, default=warmup_s, help=f"seconds per point before measuring "
                   f"(default {warmup_s:g})")  # fmt: skip
    p.add_argument("--processes", type=count, default=None, help="client processes (default: cores, at most 4)")


def length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition("..")
    try:
        low, high = int(low), int(high or low)
    except ValueError:
        low = high = 0  # refused below, with what it takes
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected LEN or MIN..MAX with 1 <= MIN <= MAX, got {text!r}")
    return low, high


def check_writable(path: Path, flag: str) -> None:
    """A file the command will write at its end can be: its folder exists and takes files, and it is no folder."""
    folder = path.parent
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; give a file name")
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: the folder {folder} does not exist")
    _try_writing(path, flag)


def check_writable_folder(folder: Path, flag: str) -> None:
    """A folder the command will write files into at its end can be: made if it is not there, and takes a file."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder}: is a file; give a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"{flag} {folder}: cannot be made ({error.strerror})") from None
    _try_writing(folder / ".mhaserve-write-check", flag)


def check_folder_can_be_made(folder: Path, flag: str) -> None:
    """A folder the command writes whole at its end (made beside it, then moved into place) can be: its parent is
    made where it is missing, as the command would, and takes a new folder."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"{flag} {folder}: is a file; give a folder")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        os.rmdir(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    except OSError as error:
        raise UsageError(f"{flag} {folder}: cannot be made ({error.strerror})") from None


def _try_writing(path: Path, flag: str) -> None:
    """Open ``path`` for appending, as the end will write it, and leave it as it was: a folder that the permission
    bits allow may still refuse files (a read-only mount, /proc, a full disk's quota)."""
    existed = path.exists()
    try:
        with open(path, "ab"):
            pass
    except OSError as error:
        raise UsageError(f"{flag} {path}: cannot be written ({error.strerror})") from None
    if not existed:
        path.unlink(missing_ok=True)
