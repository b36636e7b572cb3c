"""glibc's allocator, tuned for a server whose responses are large buffers (no-ops elsewhere)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


def _libc():
    name = ctypes.util.find_library("c")
    if not name or not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def tune_malloc() -> None:
    """Keep large response buffers in the heap instead of fresh mmap()s.

    With glibc's defaults each large buffer is a new mmap, page-faulted and zeroed, which made serialising
    a large response ten times slower (BENCHMARKS.md, "Figures behind the server's defaults").
    """
    libc = _libc()
    try:
        m_trim_threshold, m_mmap_threshold = -1, -3
        libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum for this threshold
        libc.mallopt(m_trim_threshold, 256 << 20)
    except AttributeError:  # not glibc: leave the allocator alone
        pass


def release_free_memory() -> None:
    """Give freed heap pages back to the system now (the raised trim threshold would keep up to 256 MiB):
    after a model version is unloaded, its weights' pages should leave the process's RSS."""
    libc = _libc()
    try:
        libc.malloc_trim(0)
    except AttributeError:
        pass
