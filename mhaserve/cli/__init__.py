"""The ``mhaserve`` command: export, validate, serve, infer, health, bench, ray-deploy."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
