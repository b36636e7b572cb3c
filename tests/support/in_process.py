"""A real server in the test's own process: the same ``Server`` as ``mhaserve serve`` (grpc.aio and aiohttp on
127.0.0.1, the data plane, ONNX Runtime), its phases run on an event loop of its own in a thread, so that tests
talk to it with the real synchronous clients. No interpreter to start, no imports to repeat: a start costs the
model's load and warm-up only.

Where the process is the point (signals and drain, memory as RSS, exit codes, environment variables), tests
start a ``ServerProcess`` instead.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import threading
from pathlib import Path

from mhaserve.server.app import Server, StartFailed
from mhaserve.server.config import add_server_arguments, settings_from_args
from mhaserve.server.logs import ACCESS, formatter


class _Lines(logging.Handler):
    """The server's log lines, kept as the process's stderr would show them (in ``--log-format``)."""

    def __init__(self, lines: list[str], log_format: str):
        super().__init__()
        self.lines = lines
        self.setFormatter(formatter(log_format))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record) + "\n")


class InProcessServer:
    """``InProcessServer(model_dir, *flags)``: what ``ServerProcess`` offers (url, http_url, metrics_url, log,
    stop_line, pid, alive, stop). ``start`` raises StartFailed if it cannot serve."""

    def __init__(self, model_dir: Path | None, *args: str, port: int = 0):
        parser = argparse.ArgumentParser()
        add_server_arguments(parser)
        flags = [*(("--model-dir", str(model_dir)) if model_dir else ()), "--host", "127.0.0.1", "--port", str(port)]
        # No grace period unless a test asks for one: ``stop`` cuts what is in flight (a drain is a process's).
        flags += ["--metrics-port", "0", "--http-port", "0", "--grace-seconds", "0"]
        self.settings = settings_from_args(parser.parse_args([*flags, *args]))
        self.host, self.port = self.settings.host, port
        self.http_url: str | None = None
        self.metrics_url: str | None = None
        self.lines: list[str] = []
        self.server: Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._failure: BaseException | None = None  # what the start, or the drain and stop, raised
        self._drain = False
        self._thread: threading.Thread | None = None
        self._handler = _Lines(self.lines, self.settings.log_format)
        self._levels: list[tuple[logging.Logger, int]] = []

    @property
    def url(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def pid(self) -> int:
        return os.getpid()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stop_line(self) -> str:
        return next((line.strip() for line in reversed(self.lines) if "stopped:" in line), "(no stop line)")

    def start(self, timeout: float = 60.0) -> InProcessServer:
        self._listen()
        self._thread = threading.Thread(target=self._run, name="in-process-server", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise RuntimeError(f"the in-process server did not start within {timeout} s:\n{self.log}")
        if self._failure is not None:
            self._thread.join(30)
            self._unlisten()
            raise self._failure
        return self

    def _listen(self) -> None:
        level = getattr(logging, self.settings.log_level.upper())
        access = logging.INFO if self.settings.access_log else logging.WARNING
        for logger, wanted in ((logging.getLogger("mhaserve"), level), (ACCESS, access)):
            self._levels.append((logger, logger.level))
            logger.setLevel(wanted)
        logging.getLogger("mhaserve").addHandler(self._handler)

    def _unlisten(self) -> None:
        logging.getLogger("mhaserve").removeHandler(self._handler)
        for logger, level in reversed(self._levels):
            logger.setLevel(level)
        self._levels = []

    def _run(self) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._loop.run_until_complete(self._life())
        finally:
            self._loop.close()

    async def _life(self) -> None:
        self._stop = asyncio.Event()
        server = Server(self.settings)
        try:
            await server.bind()
            await server.load()
        except BaseException as failure:
            if isinstance(failure, StartFailed):
                logging.getLogger("mhaserve.server").error("%s", failure.reason)
            await server.stop()
            self._failure = failure
            self._started.set()
            return
        await server.serve()
        self.server, self.port = server, server.port
        if server.http_address != "off":
            self.http_url = f"http://{server.http_address}"
        if server.metrics_address != "off":
            self.metrics_url = f"http://{server.metrics_address}/metrics"
        self._started.set()
        await self._stop.wait()
        try:
            if self._drain:
                await server.drain()
            await server.stop()
        except BaseException as failure:  # raised by ``stop`` in the test's thread
            self._failure = failure

    def stop(self, drain: bool = False) -> None:
        """Stop it, after the drain SIGTERM starts (``drain``), else cutting off what is in flight (the signal
        itself is tested on server processes). Raises what the drain or the stop raised."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._drain = drain
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        self._unlisten()
        if self._failure is not None:
            raise self._failure

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def refused_start(model_dir: Path | None, *args: str) -> tuple[StartFailed, str]:
    """Why a server with these flags refuses to start, which it must (its exit code is the process's), and its
    log lines."""
    server = InProcessServer(model_dir, *args)
    try:
        server.start()
    except StartFailed as failure:
        return failure, server.log
    server.stop()
    raise AssertionError(f"the server started; a refusal was expected:\n{server.log}")
