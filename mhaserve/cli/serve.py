"""``mhaserve serve``: the server, on a model folder, a repository, or the embedded default model."""

from __future__ import annotations

import sys

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
    from mhaserve.server.process import end_with_the_parent_if_asked

    end_with_the_parent_if_asked()
    settings = settings_from_args(args)
    from mhaserve.server.ports import address_problem, busy_port_message

    if (problem := address_problem(settings) or busy_port_message(settings)) is not None:
        raise UsageError(problem)  # before a first run's export, not after it
    if settings.workers != 1:
        from mhaserve.server.workers import check_workers

        check_workers(settings)
    model_dir = None
    if not settings.model_repository:
        from mhaserve.export.default_model import default_model_ready, ensure_default_model

        if settings.model_dir is None and not default_model_ready():
            require_extra("export", "the first run's export of the default model")
        model_dir = settings.model_dir or ensure_default_model()
    if settings.workers != 1:
        from mhaserve.server import logs
        from mhaserve.server.workers import run_workers

        logs.configure(settings.log_level, settings.log_format, settings.access_log)
        argv = sys.argv[sys.argv.index("serve") + 1 :]
        if model_dir is not None and settings.model_dir is None:  # the default model, exported once, for all
            argv += ["--model-dir", str(model_dir)]
        return run_workers(settings, argv)
    return run(settings, model_dir)
