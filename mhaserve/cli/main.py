"""The ``mhaserve`` command: export, validate, serve, infer, bench, tune, health, models, ray-deploy.

Each subcommand imports what it needs when it runs, so ``serve`` and ``infer`` never load torch."""

from __future__ import annotations

import argparse
import os
import signal
import sys

from mhaserve.contract.errors import UsageError

from .bench import add_bench
from .common import merge_model_dir
from .export import add_export, add_validate
from .infer import add_health, add_infer
from .models import add_models
from .ray_deploy import add_ray_deploy
from .serve import add_serve
from .tune import add_tune


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusal is its one line and where to look, not the whole usage first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n(the flags: {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but what a subcommand cannot read is refused by that subcommand's parser, pointing to its
        own help (argparse leaves unrecognized arguments to the top-level parser)."""
        parsed, unrecognized = self.parse_known_args(args, namespace)
        command = self._command_parser(parsed)
        if unrecognized:
            command.error(f"unrecognized arguments: {' '.join(unrecognized)}")
        if problem := merge_model_dir(parsed):
            command.error(problem)
        return parsed

    def _command_parser(self, parsed) -> argparse.ArgumentParser:
        (commands,) = [a for a in self._actions if isinstance(a, argparse._SubParsersAction)]
        return commands.choices.get(getattr(parsed, "command", None), self)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mhaserve", description=__doc__.splitlines()[0].replace("``", ""))
    sub = parser.add_subparsers(dest="command", required=True)
    add_export(sub)
    add_validate(sub)
    add_serve(sub)
    add_infer(sub)
    add_bench(sub)
    add_tune(sub)
    add_health(sub)
    add_models(sub)
    add_ray_deploy(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        code = _run(argv)
        sys.stdout.flush()  # here, not at the interpreter's exit, where a broken pipe is a traceback
        return code
    except BrokenPipeError:  # its reader went away (``| head``): as a Unix tool ends on SIGPIPE, with no word
        _quiet_stdout()
        return 128 + signal.SIGPIPE


def _run(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as error:  # the user's input: one line, exit code 2, as argparse does
        print(f"{parser.prog} {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _quiet_stdout() -> None:
    """Stdout pointed at /dev/null, so that the interpreter's own flush at exit meets no broken pipe (the way
    Python's documentation gives for SIGPIPE)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


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
