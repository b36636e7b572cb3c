"""``mhaserve serve --workers N``: N serving processes on the same ports, started, watched and stopped as one server.

Each worker is a whole ``mhaserve serve`` (its own event loop, model, batching, memory budget and sequences) bound
with SO_REUSEPORT, so the kernel spreads connections over them (by a hash of their addresses: a few may share a
worker); a gRPC channel stays on the worker it connected to. The parent imports no model runtime: it picks the
ports once (a port 0 becomes one free port all share), divides ONNX Runtime's threads (and makes the board on which
the workers mark their runs, so that one running alone takes every core's: threads.WorkerBoard), starts the workers,
relays their logs prefixed with their number, restarts one that dies, serves the one /metrics of the whole server
(every worker's series with a ``worker`` label, from each worker's own metrics port on loopback), and on SIGTERM or
SIGINT passes it on and waits for every worker's drain.

ModelStatistics, from whichever worker answers it, is the whole server's: the worker adds the others' (read from
their metrics ports on loopback). A sequence lives in one worker, and its steps reach it from any connection
(worker_forward.py: the parent gives each worker the others' forward sockets). Explicit model control
(RepositoryModelLoad/Unload) and client shared memory reach every worker: the worker that takes the call tells the
others over the same sockets, and a worker started again takes their state. What is per worker: trace settings
changed at run time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from mhaserve.contract.errors import UsageError

from .config import ServerSettings
from .cores import limit_said, usable_cores
from .ports import host_port
from .process import ended_with_the_parent
from .rest.prometheus import start_metrics
from .threads import ALONE_THREADS_ENV, BOARD_ENV, WORKER_ENV, WorkerBoard
from .worker_forward import SOCKETS_ENV, socket_paths

log = logging.getLogger("mhaserve.server")

RESTARTED_ENV = "MHASERVE_WORKER_RESTARTED"  # when a worker was started again, in place of one that exited
PEERS_ENV = "MHASERVE_WORKER_PEERS"  # and every worker's own metrics address on loopback, in worker order
RESTART_DELAY_S = 1.0  # a worker that died is started again after this
READY_TIMEOUT_S = 600.0  # a worker not serving by then (its model's load included) fails the start


def check_workers(settings: ServerSettings) -> None:
    """What cannot work across several processes, refused before any starts (UsageError)."""
    if settings.port == 0 or settings.http_port == 0:
        return
    if settings.port == settings.http_port:
        raise UsageError(f"--port and --http-port are both {settings.port}")


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


@dataclass
class Worker:
    index: int
    metrics_port: int  # its own metrics endpoint, on loopback: the parent's /metrics reads it
    process: subprocess.Popen | None = None
    started: float = 0.0
    ready: threading.Event = field(default_factory=threading.Event)
    serving_line: str = ""
    restarts: int = 0


class Workers:
    """The workers of one server and what the parent does for them (see the module doc)."""

    def __init__(self, settings: ServerSettings, argv: list[str]):
        self.settings = settings
        cores = usable_cores()
        self.count = settings.workers or cores  # 0: one per core
        self.port = settings.port or _free_port(settings.host)
        self.http_port = settings.http_port if settings.http_port != 0 else _free_port(settings.host)
        self.threads = settings.intra_op_threads or max(1, cores // self.count)
        # The threads divided by the parent: a worker's run takes every core's while the others run nothing.
        self.alone_threads = cores if not settings.intra_op_threads and self.threads < cores else 0
        self.board = WorkerBoard.create(self.count)
        self.workers = [Worker(i, _free_port("127.0.0.1")) for i in range(self.count)]
        # Each worker's socket for the steps the others forward to it, in a folder only this user may enter.
        self.forward_folder = Path(tempfile.mkdtemp(prefix="mhaserve-workers-"))
        self.forward_sockets = socket_paths(self.forward_folder, self.count)
        self._argv = argv
        self._stopping = False
        self._lock = threading.Lock()

    def command(self, worker: Worker) -> list[str]:
        """The worker's ``mhaserve serve``: the parent's own arguments, then what makes it one of the workers (the
        last of a repeated flag wins)."""
        overrides = [
            "--workers", "1", "--reuse-port", "true", "--port", str(self.port), "--http-port", str(self.http_port),
            "--metrics-port", str(worker.metrics_port), "--metrics-host", "127.0.0.1",
            "--intra-op-threads", str(self.threads),
        ]  # fmt: skip
        return [sys.executable, "-m", "mhaserve.cli", "serve", *self._argv, *overrides]

    def start(self, worker: Worker) -> None:
        peers = ",".join(f"127.0.0.1:{each.metrics_port}" for each in self.workers)
        env = {**os.environ, WORKER_ENV: str(worker.index), PEERS_ENV: peers, BOARD_ENV: str(self.board),
               SOCKETS_ENV: ",".join(self.forward_sockets)}  # fmt: skip
        if self.alone_threads:
            env[ALONE_THREADS_ENV] = str(self.alone_threads)
        if worker.restarts:  # its sequences were lost with the process it replaces
            env[RESTARTED_ENV] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        worker.ready.clear()
        worker.process = subprocess.Popen(
            self.command(worker),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            pass_fds=(self.board,),
            preexec_fn=ended_with_the_parent if sys.platform.startswith("linux") else None,
        )
        worker.started = time.monotonic()
        log.info("worker %d started (pid %d)", worker.index, worker.process.pid)
        threading.Thread(target=self._relay, args=(worker, worker.process), daemon=True).start()

    def _relay(self, worker: Worker, process: subprocess.Popen) -> None:
        """The worker's log lines on the parent's stderr, each prefixed with its number; its serving line read."""
        for line in process.stderr:
            if f"worker {worker.index} ready: " in line:
                worker.serving_line = line
                worker.ready.set()
            sys.stderr.write(f"[worker {worker.index}] {line}")
        sys.stderr.flush()

    def serving_line(self, metrics_address: str) -> str:
        """The parent's own serving line: worker 0's, with the whole server's metrics address and its workers."""
        line = self.workers[0].serving_line.strip()
        served = "serving " + line.split(" ready: ", 1)[1].removesuffix('"}').removesuffix('"')
        served = served.replace(
            f"metrics={host_port('127.0.0.1', self.workers[0].metrics_port)}", f"metrics={metrics_address}"
        )
        return f"{served} processes={self.count}"

    def wait_ready(self) -> int | None:
        """None once every worker serves; else the exit code of the first that ended before it did."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        for worker in self.workers:
            while not worker.ready.wait(0.05):
                code = worker.process.poll()
                if code is not None:
                    return code or 1
                if time.monotonic() > deadline:
                    return 3
        return None

    def watch(self) -> None:
        """Restart a worker that died, until the server stops. (Runs in a thread of its own.)"""
        while not self._stopping:
            time.sleep(0.2)
            for worker in self.workers:
                with self._lock:
                    if self._stopping:
                        return
                    code = worker.process.poll()
                    if code is None:
                        continue
                    log.warning("worker %d (pid %d) exited with %s; starting it again", worker.index,
                                worker.process.pid, _exit_said(code))  # fmt: skip
                    worker.restarts += 1
                time.sleep(RESTART_DELAY_S)
                with self._lock:
                    if not self._stopping:
                        self.start(worker)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """Every worker told to stop (each drains as one server does), then waited for; SIGKILL past the grace."""
        with self._lock:
            self._stopping = True
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                worker.process.send_signal(signum)
        deadline = time.monotonic() + self.settings.drain_seconds + self.settings.grace_seconds + 15
        for worker in self.workers:
            if worker.process is None:
                continue
            try:
                worker.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("worker %d did not stop in time: killed", worker.index)
                worker.process.kill()
                worker.process.wait()
        shutil.rmtree(self.forward_folder, ignore_errors=True)

    def metrics_text(self) -> bytes:
        """The whole server's metrics: each worker's, every series labelled with its worker."""
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.parser import text_string_to_metric_families

        families: dict[str, object] = {}
        for worker in self.workers:
            url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    text = response.read().decode()
            except OSError:  # restarting: its series are missing from this scrape
                continue
            for family in text_string_to_metric_families(text):
                merged = families.setdefault(family.name, _empty_like(family))
                for sample in family.samples:
                    merged.samples.append(sample._replace(labels={**sample.labels, "worker": str(worker.index)}))

        class Collected:
            def collect(self):
                return list(families.values())

        registry = CollectorRegistry(auto_describe=False)
        registry.register(Collected())
        return generate_latest(registry)


def is_worker() -> bool:
    """Whether this process is one of ``--workers``."""
    return WORKER_ENV in os.environ


async def peers_statistics(timeout_s: float = 2.0) -> list[list[dict]]:
    """The other workers' statistics, each worker's list of model_stats (describe.model_statistics), read from
    their own metrics ports; a worker that does not answer (restarting) is left out. [] outside workers."""
    if not is_worker():
        return []
    import aiohttp

    own = int(os.environ[WORKER_ENV])
    peers = [address for index, address in enumerate(os.environ.get(PEERS_ENV, "").split(",")) if index != own]
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def read(address: str) -> list[dict] | None:
            try:
                async with session.get(f"http://{address}/statistics") as response:
                    return (await response.json())["model_stats"]
            except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, ValueError):
                return None

        answers = await asyncio.gather(*(read(address) for address in peers if address))
    return [answer for answer in answers if answer is not None]


def _empty_like(family):
    from prometheus_client.metrics_core import Metric

    return Metric(family.name, family.documentation, family.type, family.unit)


def _exit_said(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


def run_workers(settings: ServerSettings, argv: list[str]) -> int:
    """Serve with ``settings.workers`` processes until SIGTERM or SIGINT; the exit code (a worker's start failure's,
    else 0)."""
    check_workers(settings)
    if limited := limit_said():
        log.info(limited)
    workers = Workers(settings, argv)
    return asyncio.run(_run(workers, settings))


async def _run(workers: Workers, settings: ServerSettings) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    for worker in workers.workers:
        workers.start(worker)
    ready = loop.run_in_executor(None, workers.wait_ready)
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait({ready, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set() or (failed := ready.result()) is not None:
        await loop.run_in_executor(None, workers.stop)
        return 0 if stop.is_set() else failed
    stopping.cancel()

    async def exposition() -> bytes:  # every worker's, read off the event loop
        return await loop.run_in_executor(None, workers.metrics_text)

    try:
        runner, metrics_address = await start_metrics(settings, exposition)
    except OSError as error:
        log.error("could not start the metrics endpoint: %s", error)
        await loop.run_in_executor(None, workers.stop)
        return 2
    log.info("%s", workers.serving_line(metrics_address))
    threading.Thread(target=workers.watch, daemon=True).start()
    await stop.wait()
    log.info("stopping: every worker drains")
    await loop.run_in_executor(None, workers.stop)
    if runner is not None:
        await runner.cleanup()
    log.info("stopped: %d workers, %d restarts", workers.count, sum(w.restarts for w in workers.workers))
    return 0
