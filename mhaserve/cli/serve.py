"""``mhaserve serve``: the server, on a model folder, a repository, or the embedded default model."""

from __future__ import annotations

from mhaserve.contract.errors import UsageError

from .common import (
    require_extra,
)


def add_serve(sub) -> None:
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
