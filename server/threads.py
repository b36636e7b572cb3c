"""The server's worker threads: their priority (inference and decoding run below the event loop's, so that health
checks and small requests are answered while large ones compute), and, in one of --workers, the board on which a
worker marks its runs (its inference threads', and a lone one on its event loop) for the other workers to see."""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

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


def lowered_pool(workers: int, name: str, nice: int, board: WorkerBoard | None = None) -> ThreadPoolExecutor:
    """A pool whose threads run ``nice`` below the event loop's (see lower_thread_priority); with a worker board,
    each task marked on it while it runs (the model runs of one of --workers)."""
    options = dict(thread_name_prefix=f"mhaserve-{name}", initializer=lower_thread_priority, initargs=(nice,))
    if board is not None:
        return _MarkedPool(board, workers, **options)
    return ThreadPoolExecutor(workers, **options)


# Set by the parent of --workers in each worker's environment: the file descriptor of the workers' board
# (WorkerBoard), and the threads a run may take while the other workers are quiet (every core's).
WORKER_ENV = "MHASERVE_WORKER"  # a worker's number
BOARD_ENV = "MHASERVE_WORKER_BOARD"
ALONE_THREADS_ENV = "MHASERVE_ALONE_THREADS"
# How long the other workers must have run nothing for a run to take every core's threads: far longer than the gaps
# between a loaded worker's runs, so that under load each worker keeps its share.
QUIET_S = 0.05
_BUSY = -1


class WorkerBoard:
    """Which of a server's worker processes are running models: a file of one 8-byte slot per worker, each written
    by its own worker alone (-1 while it has runs in flight, else when its last run ended, on the system's monotonic
    clock) and read by the others. The file has no name (the parent passes it to each worker it starts), so nothing
    is left behind whichever way the server ends."""

    def __init__(self, board: int, index: int):
        self._slots = np.frombuffer(mmap.mmap(board, 0), np.int64)
        self._index = index
        self._in_flight = 0
        self._lock = threading.Lock()
        self._slots[index] = 0  # quiet: a worker started again after dying in a run is not busy still

    @staticmethod
    def create(workers: int) -> int:
        """The board's file, every worker quiet: its descriptor."""
        if hasattr(os, "memfd_create"):  # Linux
            board = os.memfd_create("mhaserve-workers")
        else:
            with tempfile.TemporaryFile() as unnamed:
                board = os.dup(unnamed.fileno())
        os.ftruncate(board, 8 * workers)
        return board

    @contextlib.contextmanager
    def running(self):
        """A run of this worker's, marked while it lasts (an inference thread's, or a lone one on the event loop)."""
        with self._lock:
            self._in_flight += 1
            self._slots[self._index] = _BUSY
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1
                if not self._in_flight:
                    self._slots[self._index] = time.monotonic_ns()

    def others_quiet(self) -> bool:
        """Whether no other worker has run anything for QUIET_S."""
        since = time.monotonic_ns() - int(QUIET_S * 1e9)
        others = np.delete(self._slots, self._index)  # a copy: read once
        return not ((others == _BUSY) | (others > since)).any()


def worker_board() -> WorkerBoard | None:
    """This worker's board (its parent made it), or None outside --workers."""
    global _BOARD
    if _BOARD is None and BOARD_ENV in os.environ:
        _BOARD = WorkerBoard(int(os.environ[BOARD_ENV]), int(os.environ[WORKER_ENV]))
    return _BOARD


_BOARD: WorkerBoard | None = None


def runs_alone() -> tuple[int, Callable[[], bool] | None]:
    """The threads a model run of this worker takes while the other workers are quiet, and what says they are:
    (0, None) outside --workers or where the threads were not divided by the parent."""
    board, threads = worker_board(), int(os.environ.get(ALONE_THREADS_ENV, 0))
    return (threads, board.others_quiet) if board is not None and threads else (0, None)


class _MarkedPool(ThreadPoolExecutor):
    """A pool whose every task is marked on the worker board while it runs."""

    def __init__(self, board: WorkerBoard, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._board = board

    def submit(self, fn, /, *args, **kwargs):
        board = self._board

        def marked():
            with board.running():
                return fn(*args, **kwargs)

        return super().submit(marked)
