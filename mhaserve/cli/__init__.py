"""The ``mhaserve`` command: export, validate, serve, infer, health, bench, ray-deploy."""

from .main import build_parser, main, process_main

__all__ = ["build_parser", "main", "process_main"]
