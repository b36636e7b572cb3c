"""Attention weights as a heatmap PNG, drawn with matplotlib (the `plot` extra)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mhaserve.contract.errors import UsageError


def write_heatmap(weights: np.ndarray, path: str | Path, title: str) -> None:
    """Write [Lq, Lk] weights as a PNG: query positions down, key positions across, a colour bar."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state
    except ImportError:
        raise UsageError("--heatmap draws with matplotlib: pip install 'mhaserve[plot]'") from None
    q_len, kv_len = weights.shape
    # About 6 inches on the longer side, whatever the lengths, so a [1, 512] map is not a hairline.
    scale = 6.0 / max(q_len, kv_len)
    figure = Figure(figsize=(max(3.5, kv_len * scale + 1.5), max(2.5, q_len * scale + 1.0)), layout="constrained")
    axes = figure.add_subplot()
    image = axes.imshow(weights, cmap="viridis", aspect="auto", interpolation="nearest", vmin=0.0)
    axes.set_xlabel("key position")
    axes.set_ylabel("query position")
    axes.set_title(title)
    figure.colorbar(image, ax=axes, label="attention weight")
    figure.savefig(Path(path), dpi=100)
