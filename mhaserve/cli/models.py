"""``mhaserve models``: a running server's repository, each model's versions with their states and why, and the
loads and unloads of explicit model control (``--model-control-mode explicit``), with a configuration for a load
from a file as Triton's load takes one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mhaserve.contract.errors import UsageError

from .common import (
    add_connection_arguments,
    add_protocol_argument,
    connection_of,
    failure_message,
    make_client,
    seconds,
)

ACTIONS = ("list", "load", "unload")


def add_models(sub) -> None:
    p = sub.add_parser(
        "models",
        help="list a server's models and versions with their states; load or unload one (explicit model control)",
        description="mhaserve models [[list] NAME] | load NAME [--config FILE_OR_JSON] | unload NAME",
    )
    p.add_argument("action", nargs="?", default="list", metavar="{list,load,unload}",
                   help="list (the default): the repository index; load: load NAME, or load it again to read its "
                   "folder anew; unload: stop serving NAME")  # fmt: skip
    p.add_argument("name", nargs="?", help="the model (list: only its versions; 'mhaserve models NAME' lists them too)")
    p.add_argument("--ready", action="store_true", help="list: only the versions ready for inference")
    p.add_argument("--config", metavar="FILE_OR_JSON",
                   help="load: the model's configuration for this load, in place of its config.pbtxt until a load "
                   "without one: a file in Triton's text format (as config.pbtxt) or JSON, or JSON itself")  # fmt: skip
    p.add_argument("--unload-dependents", action="store_true", help="unload: Triton's parameter of that name")
    p.add_argument("--timeout", type=seconds, default=None, help="deadline of the call, seconds (default: none; "
                   "a load waits for the model's sessions and warm-up)")  # fmt: skip
    add_connection_arguments(p)
    add_protocol_argument(p)
    p.set_defaults(run=_run_models, model="mha", version="")


def _run_models(args) -> int:
    from mhaserve.client import RequestFailed

    if args.action not in ACTIONS:
        if args.name is not None:
            raise UsageError(f"{args.action!r} is not list, load or unload")
        args.action, args.name = "list", args.action  # mhaserve models NAME
    if args.action != "list" and not args.name:
        raise UsageError(f"{args.action} needs the model's name: mhaserve models {args.action} NAME")
    for flag, action, given in (("--ready", "list", args.ready), ("--config", "load", args.config is not None),
                                ("--unload-dependents", "unload", args.unload_dependents)):  # fmt: skip
        if given and args.action != action:
            raise UsageError(f"{flag} is for 'mhaserve models {action}', not {args.action}")
    config = _config_json(args.config) if args.config is not None else None
    tls, token = connection_of(args)
    with make_client(args, tls, token) as client:
        try:
            if args.action == "load":
                client.load_model(args.name, config=config, timeout=args.timeout)
            elif args.action == "unload":
                client.unload_model(args.name, unload_dependents=args.unload_dependents, timeout=args.timeout)
            entries = client.repository_index(ready=args.ready, timeout=args.timeout)
        except RequestFailed as error:
            print(failure_message(error), file=sys.stderr)
            return 1
    if args.name:
        entries = [entry for entry in entries if entry.name == args.name]
    if args.action == "list" and args.name and not entries:
        missing = f"no version of {args.name!r} is ready" if args.ready else f"no model {args.name!r} in the repository"
        print(f"{args.url}: {missing}", file=sys.stderr)
        return 1
    _print_index(entries)
    return 0


def _print_index(entries) -> None:
    """The index as a table: model, version, state and why, one version a line."""
    rows = [("MODEL", "VERSION", "STATE", "REASON")]
    rows += [(entry.name, entry.version or "-", entry.state, entry.reason) for entry in entries]
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    for name, version, state, reason in rows:
        print(f"{name:{widths[0]}}  {version:{widths[1]}}  {state:{widths[2]}}  {reason}".rstrip())


def _config_json(given: str) -> str:
    """``--config`` as the load's JSON: JSON given as it is, or a file's, in JSON or Triton's text format (read as the
    server reads config.pbtxt, and sent as JSON); what cannot be read is one line naming it."""
    text, source = given, "--config"
    if not given.lstrip().startswith("{"):
        source = f"--config {given}"
        try:
            text = Path(given).read_text(encoding="utf-8")
        except OSError as error:
            raise UsageError(f"{source}: cannot read it ({error.strerror}); give a file, or the JSON itself") from None
        except UnicodeDecodeError as error:
            raise UsageError(f"{source}: not text ({error.reason})") from None
    if text.lstrip().startswith("{"):
        try:
            if not isinstance(json.loads(text), dict):
                raise ValueError("expected a JSON object")
        except ValueError as error:
            raise UsageError(f"{source}: not a model configuration in JSON ({error})") from None
        except RecursionError:
            raise UsageError(f"{source}: nested deeper than a model configuration is") from None
        return text
    from google.protobuf import json_format

    from mhaserve.contract.model_dir import ModelDirError
    from mhaserve.server.model_config import config_of_text

    try:
        config = config_of_text(text, given)
    except ModelDirError as error:
        raise UsageError(f"--config {error}") from None
    return json_format.MessageToJson(config, preserving_proto_field_name=True, indent=None)
