"""The priority of the server's worker threads: inference and decoding run below the event loop's, so that
health checks and small requests are answered while large ones compute."""

from __future__ import annotations

import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("mhaserve.server")


def lower_thread_priority(nice: int) -> None:
    """Add ``nice`` to the calling thread's nice value (Linux keeps one per thread; new threads inherit it)."""
    if not nice or not sys.platform.startswith("linux"):
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, os.getpriority(os.PRIO_PROCESS, thread) + nice)
    except OSError as error:  # a sandbox may forbid it; serving matters more than the priority
        log.warning("could not lower the inference threads' priority (--inference-nice %d): %s", nice, error)


def lowered_pool(workers: int, name: str, nice: int) -> ThreadPoolExecutor:
    """A pool whose threads run ``nice`` below the event loop's (see lower_thread_priority)."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix=f"mhaserve-{name}", initializer=lower_thread_priority, initargs=(nice,)
    )
