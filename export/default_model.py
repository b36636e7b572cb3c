"""The embedded default model: exported once into the user's cache, found valid there on every later start.

Torch-free: the export runs in a child process, so a serving process that calls this never imports torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mhaserve.contract.cache import cache_root
from mhaserve.contract.model_dir import why_not_current


def default_model_dir() -> Path:
    """Where ``serve`` keeps the embedded default model: $MHASERVE_CACHE, else the user's cache folder."""
    return cache_root() / "models" / "mha-d512-h8-seed0"


def default_model_ready() -> bool:
    return why_not_current(default_model_dir()) is None


def ensure_default_model() -> Path:
    """Export the default model once; later calls find it valid in the cache and return at once."""
    model_dir = default_model_dir()
    why = why_not_current(model_dir)
    if why is None:
        return model_dir
    # A damaged cache (a cut-short model.onnx, an older export) is rebuilt rather than failing every start.
    print(f"exporting the default model into {model_dir} ({why}; needs the 'export' extra)", file=sys.stderr)
    # In a child process, so the serving process never imports torch.
    done = subprocess.run([sys.executable, "-m", "mhaserve.cli", "export", "--out", str(model_dir)])
    if done.returncode != 0:
        raise SystemExit(f"exporting the default model failed (exit {done.returncode})")
    return model_dir
