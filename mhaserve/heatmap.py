"""Attention weights of one head as a PNG heatmap, with numpy and zlib alone (no plotting stack)."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import numpy as np

# Anchor colours of matplotlib's viridis, low to high, interpolated linearly.
_VIRIDIS = np.array(
    [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]],
    dtype=np.float64,
)


def colorize(matrix: np.ndarray) -> np.ndarray:
    """[H, W] values -> [H, W, 3] uint8, scaled from the matrix's min to its max."""
    m = np.asarray(matrix, dtype=np.float64)
    low, high = float(m.min()), float(m.max())
    t = (m - low) / (high - low) if high > low else np.zeros_like(m)
    position = t * (len(_VIRIDIS) - 1)
    index = np.minimum(position.astype(int), len(_VIRIDIS) - 2)
    frac = (position - index)[..., None]
    rgb = _VIRIDIS[index] * (1 - frac) + _VIRIDIS[index + 1] * frac
    return np.round(rgb).astype(np.uint8)


def write_png(rgb: np.ndarray, path: str | Path) -> None:
    height, width, _ = rgb.shape
    rows = b"".join(b"\x00" + rgb[y].tobytes() for y in range(height))  # filter type 0 per row

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    Path(path).write_bytes(
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b"")
    )


def write_heatmap(weights: np.ndarray, path: str | Path, min_pixels: int = 256) -> None:
    """Write [Lq, Lk] weights as a PNG, each cell enlarged to a square block so small maps stay visible."""
    cell = max(1, min_pixels // max(weights.shape))
    rgb = colorize(weights)
    write_png(np.repeat(np.repeat(rgb, cell, axis=0), cell, axis=1), path)
