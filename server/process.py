"""A real ``mhaserve serve`` process (on 127.0.0.1 unless its arguments say otherwise), started and stopped by
another: a Ray replica serving natively, tune, tests and benchmarks; its log kept."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

SERVING_LINE = re.compile(r"serving model=.* address=([\d.]+):(\d+)")
METRICS_ADDRESS = re.compile(r" metrics=([\d.]+:\d+) ")
HTTP_ADDRESS = re.compile(r" http=([\d.]+:\d+) ")


# The kernel gives outgoing connections their source ports from this range (Linux's ip_local_port_range): a port
# chosen there for a process to bind later can be taken meanwhile by any connection (a Ray proxy started seconds
# later once failed "Failed to bind"), so ports are chosen below it.
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
CHOSEN_BELOW_EPHEMERAL = 12000  # how many ports below the range to choose among


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a server to bind: one the kernel does not hand out to connections."""
    try:
        first_ephemeral = int(EPHEMERAL_PORTS.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    low = max(1024, first_ephemeral - CHOSEN_BELOW_EPHEMERAL)
    for _ in range(200):
        port = random.randrange(low, first_ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every one tried was taken: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM that come inside the block are acted on as it ends, by the handlers they had: a signal in
    the middle of starting a server (between the fork and the process being known) would leave it running, its
    starter gone. Main thread only (where Python runs signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    for signum in previous:
        signal.signal(signum, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for signum in came[:1]:
        handler = previous[signum]
        if callable(handler):
            handler(signum, None)  # Python's own for SIGINT raises KeyboardInterrupt
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)


class ServerProcess:
    def __init__(
        self, model_dir: Path | None, *args: str, port: int = 0, env: dict | None = None, end_with_parent=False
    ):
        """``model_dir`` None: ``args`` say what to serve (e.g. --model-repository DIR). ``end_with_parent``: the
        server ends (SIGTERM) when the thread that started it does, its starter killed outright too (Linux)."""
        self.command = [
            sys.executable, "-m", "mhaserve.cli", "serve", *(("--model-dir", str(model_dir)) if model_dir else ()),
            "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "0", "--http-port", "0", *args,
        ]  # fmt: skip
        self.env = {**os.environ, **(env or {})}
        if end_with_parent:  # end_with_the_parent_if_asked, in the server
            self.env[END_WITH_PARENT_ENV] = str(os.getpid())
        self.lines: list[str] = []
        self.port = port
        self.host = "127.0.0.1"  # the gRPC address the serving line names, once it is read
        self.metrics_url: str | None = None
        self.http_url: str | None = None  # "http://127.0.0.1:PORT" when the HTTP/REST port is on
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self._serving = threading.Event()

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def start(self, wait: bool = True, timeout: float = 60.0) -> ServerProcess:
        with _signals_held():  # a Ctrl-C now is acted on once the process is known, so that stop() can end it
            self.proc = subprocess.Popen(
                self.command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=self.env
            )
            self._reader = threading.Thread(target=self._read_log, daemon=True)
            self._reader.start()
        if wait:
            self.wait_serving(timeout)
        return self

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            match = SERVING_LINE.search(line)
            if match:
                metrics = METRICS_ADDRESS.search(line)
                self.metrics_url = f"http://{metrics.group(1)}/metrics" if metrics else None
                http = HTTP_ADDRESS.search(line)
                self.http_url = f"http://{http.group(1)}" if http else None
                self.host, self.port = match.group(1), int(match.group(2))
                self._serving.set()

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._serving.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start (exit {self.proc.poll()}):\n{self.log}")

    def signal(self, signum=signal.SIGTERM) -> None:
        self.proc.send_signal(signum)

    def wait_exit(self, timeout: float = 30.0) -> int:
        """The exit code, once the process has ended and its last log lines are read (they may still be in the
        pipe when it exits)."""
        code = self.proc.wait(timeout)
        self._last_lines_read()
        return code

    @property
    def stop_line(self) -> str:
        """The server's last word: its calls counted by status, and any still in flight."""
        return next((line.strip() for line in reversed(self.lines) if "stopped:" in line), "(no stop line)")

    def stop(self) -> int | None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self._last_lines_read()  # the stop line among them
        return self.proc.returncode if self.proc else None

    def _last_lines_read(self) -> None:
        """Wait a little for the log reader to reach the end of the pipe; none to wait for where a Ctrl-C came
        between the process's start and its reader's."""
        if self._reader is not None and self._reader.ident is not None:
            self._reader.join(5)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# A server that ends with the process that started it: a worker of --workers, a Ray replica's server.


def ended_with_the_parent() -> None:
    """In a worker of --workers, before it runs (Linux): SIGTERM when the parent's starting thread ends, so that a
    parent killed outright (SIGKILL, the OOM killer) leaves no worker holding the port. (The parent starts workers
    from its main thread, and restarts them from its watching thread, which lives until the server stops.)"""
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


def end_with_the_parent_if_asked() -> None:
    """In a server started by a Ray replica (``MHASERVE_END_WITH_PARENT``: the replica's process id), at its start
    (Linux): SIGTERM when the replica's starting thread ends, as a worker has, so that a replica killed outright
    leaves no server holding its port. Set here, after exec: a replica's process has many threads, where code run
    between fork and exec may deadlock."""
    parent = os.environ.pop(END_WITH_PARENT_ENV, None)
    if parent is None or _PRCTL is None:
        return
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # it ended before the above took effect
        os.kill(os.getpid(), signal.SIGTERM)


END_WITH_PARENT_ENV = "MHASERVE_END_WITH_PARENT"
# Looked up in the parent, once: between fork and exec the child only calls it (no loader lock to take there).
PR_SET_PDEATHSIG = 1
_PRCTL = ctypes.CDLL(None).prctl if sys.platform.startswith("linux") else None
