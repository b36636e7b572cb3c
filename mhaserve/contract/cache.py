"""mhaserve's cache folder: what the server keeps between starts on this machine (the embedded default model, the
run costs it fitted)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$MHASERVE_CACHE, else the user's cache folder's ``mhaserve``."""
    root = os.environ.get("MHASERVE_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mhaserve"
