"""The load generator behind ``mhaserve bench``: closed and open loop, spread over client processes.

Closed loop: ``concurrency`` callers, each sending its next request when the last one returns.
Open loop: requests sent on a fixed schedule (``rate`` per second) whatever the server does, and
latency counted from the *scheduled* send time, so a stalled server shows up as queueing delay
instead of being hidden by the client waiting with it (coordinated omission).

Sequences (``Workload.sequence_length``): each closed-loop caller grows sequences kept on the server one row a
step, in Triton's sequence protocol, from ``sequence_start`` to ``sequence_end`` at that length, then starts
another; each step's latency is kept with its position, so a point also says how a step's time grows with the
sequence.

Each client process prebuilds its requests, so the loop itself only sends, waits and records, and
reports its own CPU time: a client near one core per process is the bottleneck, not the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import multiprocessing
import os
import resource
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from mhaserve.client.common import SequenceStep, WeightsOptions
from mhaserve.server.cores import usable_cores

from .server_side import WindowReads

PERCENTILES = (50, 90, 95, 99, 99.9)
OPEN_LOOP_MAX_OUTSTANDING = 4096  # a server this far behind has failed the point anyway
# A request's final status and, for a refusal, what the server said (reported once per status, so that a run's
# errors say why).
Answer = tuple[str, str]
ANSWERED: Answer = ("OK", "")


@dataclass(frozen=True)
class Workload:
    """What each request looks like. Lengths are drawn uniformly from [min_len, max_len]."""

    d_model: int
    batch: int = 1
    min_len: int = 16
    max_len: int = 16
    attn_weights: bool = True
    model: str = "mha"
    version: str = ""  # empty: the newest ready version
    protocol: str = "grpc"  # grpc | http (REST, Triton's binary tensor data extension)
    application: str = ""  # the Ray Serve application to call through Ray's proxy (gRPC metadata)
    distinct_requests: int = 64  # prebuilt per process; drawn round-robin
    weights: WeightsOptions | None = None  # what each request asks of the attention weights
    attn_weights_mean: bool = False
    shared_memory: str = "none"  # system: tensors through POSIX shared memory (a server on this host)
    sequence_length: int = 0  # > 0: each request is a one-row step of a sequence grown to this many rows
    # gRPC connections in all, shared out over the client processes as the callers are (a caller, and so each of
    # its sequences, keeps to one); 0: one per client process. A server of several workers spreads connections, not
    # calls, over them (SO_REUSEPORT): load from few connections reaches few workers.
    connections: int = 0
    priority: int = 0  # the priority level each request asks for (0: the model's default)

    @property
    def shape_text(self) -> str:
        length = str(self.min_len) if self.min_len == self.max_len else f"{self.min_len}..{self.max_len}"
        steps = f" steps to {self.sequence_length}" if self.sequence_length else ""
        priority = f" at priority {self.priority}" if self.priority else ""
        return f"[{self.batch},{length},{self.d_model}]{steps}{priority}"


@dataclass(frozen=True)
class Point:
    """One measured point: closed loop at ``concurrency`` or open loop at ``rate`` requests/s."""

    mode: str  # "closed" | "open"
    load: float  # concurrency, or requests per second
    duration_s: float
    warmup_s: float

    @property
    def label(self) -> str:
        return f"concurrency {int(self.load)}" if self.mode == "closed" else f"rate {self.load:g}/s"


@dataclass
class WorkerResult:
    latencies_ns: np.ndarray  # successful requests completed in the measured window
    error_latencies_ns: dict[str, np.ndarray]  # gRPC status name -> latencies of failed requests, measured window
    cpu_s: float  # this process's user + system time in the window
    behind_ms: float = 0.0  # open loop: how late the worst send left (the client falling behind)
    dropped: int = 0  # open loop: sends skipped because too many were outstanding
    positions: np.ndarray | None = None  # sequences: each latency's step position (rows after it), in order
    error_details: dict[str, str] = field(default_factory=dict)  # status -> the first such answer's message


@dataclass
class PointResult:
    point: Point
    workload: Workload
    processes: int
    count: int
    throughput: float  # successful requests per second
    latency_ms: dict[str, float]  # p50, p90, p95, p99, p99.9, max, mean
    errors: dict[str, int]
    error_latency_ms: dict[str, dict[str, float]]  # per error status: how fast those answers came (p50, p99, max)
    client_cpu_cores: float  # all client processes together
    client_bound: bool
    behind_ms: float
    dropped: int
    latencies_ms: np.ndarray = field(repr=False)
    server: dict | None = None  # the server's side of the window (server_side.split), where it was read
    server_unread: str | None = None  # why the server's side is missing, where it was asked for and is
    rounds: dict | None = None  # with --rounds: every round's figures, their medians and spread (rounds.of_rounds)
    by_position: dict | None = None  # sequences: steps, p50 and p99 per range of positions ("1-16", "17-128", ...)
    error_details: dict[str, str] = field(default_factory=dict)  # per error status: what the server said, once

    def row(self) -> dict:
        """A flat record for JSON and CSV."""
        return {
            "mode": self.point.mode,
            "load": self.point.load,
            "shape": self.workload.shape_text,
            "attn_weights": self.workload.attn_weights,
            "shared_memory": self.workload.shared_memory,
            "weights_options": json.dumps(self.workload.weights.parameters()) if self.workload.weights else "",
            "processes": self.processes,
            "duration_s": self.point.duration_s,
            "requests": self.count,
            "throughput_per_s": round(self.throughput, 2),
            **{f"{k}_ms": round(v, 4) for k, v in self.latency_ms.items()},
            "errors": sum(self.errors.values()),
            "errors_by_status": dict(self.errors),
            "error_latency_ms": self.error_latency_ms,
            "error_details": self.error_details,
            "client_cpu_cores": round(self.client_cpu_cores, 3),
            "client_bound": self.client_bound,
            "open_loop_behind_ms": round(self.behind_ms, 3),
            "open_loop_dropped": self.dropped,
            "server": self.server,
            "server_unread": self.server_unread,
            "rounds": self.rounds,
            "by_position": self.by_position,
        }


def _queries(w: Workload, seed: int) -> list[np.ndarray]:
    """The workload's distinct queries, lengths drawn uniformly from [min_len, max_len]; each protocol's
    sender encodes them once, before the clock starts."""
    rng = np.random.default_rng(seed)
    queries = []
    for _ in range(w.distinct_requests):
        length = int(rng.integers(w.min_len, w.max_len + 1))
        queries.append(rng.standard_normal((w.batch, length, w.d_model), dtype=np.float32))
    return queries


def cpu_seconds() -> float:
    """User + system CPU time of this process so far: what a client spent."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@contextlib.contextmanager
def _regions_pool(client):
    """Shared-memory regions for requests in flight, one set each, made as concurrency needs them (the first
    requests pay the registration), reused, and unregistered and removed at the end."""
    made, free = [], []

    @contextlib.contextmanager
    def take():
        regions = free.pop() if free else None
        if regions is None:
            regions = client.shared_memory()
            made.append(regions)
        try:
            yield regions
        finally:
            free.append(regions)

    try:
        yield take
    finally:
        for regions in made:
            regions.close()


@contextlib.asynccontextmanager
async def _grpc_sender(url: str, workload: Workload, seed: int, timeout_s: float, tls, token, connections: int = 1):
    """An async function sending request i from caller ``caller`` and returning its final status, over gRPC, each
    caller on one of ``connections`` channels."""
    import grpc

    from mhaserve.client.grpc import Client, build_infer_request, call_metadata, open_channel
    from mhaserve.protos.generated import grpc_service_pb2 as pb
    from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

    queries = _queries(workload, seed)

    def request(q, regions=None, heads=0, sequence=None):
        return build_infer_request(
            workload.model,
            q,
            attn_weights=workload.attn_weights,
            attn_weights_mean=workload.attn_weights_mean,
            version=workload.version,
            weights=workload.weights,
            shared_memory=regions,
            num_heads=heads,
            sequence=sequence,
            priority=workload.priority,
        )

    shared = workload.shared_memory == "system"
    requests = [] if shared else [request(q) for q in queries]
    metadata = call_metadata(token, workload.application)  # no retries: a load test reports every refusal
    async with contextlib.AsyncExitStack() as channels:
        stubs = []
        for _ in range(connections):
            channel = await channels.enter_async_context(open_channel(url, tls, aio=True, own_connection=True))
            stubs.append(pb_grpc.GRPCInferenceServiceStub(channel))
        for stub in stubs:  # each connected before the measured window
            await stub.ServerLive(pb.ServerLiveRequest(), timeout=30, wait_for_ready=True, metadata=metadata)
        with contextlib.ExitStack() as stack:
            if shared:  # registrations go through a blocking client; inference stays on this channel
                control = Client(url, workload.model, tls=tls, token=token, version=workload.version)
                stack.enter_context(control)
                heads, take = control.num_heads(), stack.enter_context(_regions_pool(control))

            async def send(i: int, step: SequenceStep | None = None, caller: int = 0) -> Answer:
                stub = stubs[caller % len(stubs)]
                try:
                    if step is not None:  # a sequence's step: its parameters differ from call to call
                        await stub.ModelInfer(request(queries[i % len(queries)], sequence=step), timeout=timeout_s,
                                              metadata=metadata)  # fmt: skip
                        return ANSWERED
                    if not shared:
                        await stub.ModelInfer(requests[i % len(requests)], timeout=timeout_s, metadata=metadata)
                        return ANSWERED
                    with take() as regions:
                        placed = request(queries[i % len(queries)], regions, heads)
                        await stub.ModelInfer(placed, timeout=timeout_s, metadata=metadata)
                    return ANSWERED
                except grpc.aio.AioRpcError as error:
                    return error.code().name, error.details() or ""

            yield send


@contextlib.asynccontextmanager
async def _http_sender(url: str, workload: Workload, seed: int, timeout_s: float, tls, token, connections: int = 1):
    """The same over HTTP/REST, each request's body built beforehand (binary tensor data); a connection for each
    request in flight (aiohttp's pool), whatever ``connections`` says."""
    import aiohttp

    from mhaserve.client.http import STATUS_NAMES, HttpClient, build_http_infer_body, error_message, ssl_context

    queries = _queries(workload, seed)

    def body(q, regions=None, heads=0, sequence=None):
        return build_http_infer_body(
            q,
            attn_weights=workload.attn_weights,
            attn_weights_mean=workload.attn_weights_mean,
            weights=workload.weights,
            shared_memory=regions,
            num_heads=heads,
            sequence=sequence,
            priority=workload.priority,
        )

    shared = workload.shared_memory == "system"
    bodies = [] if shared else [body(q) for q in queries]
    path = f"/v2/models/{workload.model}" + (f"/versions/{workload.version}" if workload.version else "")
    base = f"{'https' if tls else 'http'}://{url}"
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    connector = aiohttp.TCPConnector(limit=0, ssl=ssl_context(tls) or False)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(base, connector=connector, timeout=timeout, headers=auth) as session:
        async with session.get("/v2/health/live") as response:
            response.raise_for_status()
        with contextlib.ExitStack() as stack:
            if shared:
                control = HttpClient(url, workload.model, tls=tls, token=token, version=workload.version)
                heads, take = control.num_heads(), stack.enter_context(_regions_pool(control))

            async def post(payload, headers) -> Answer:
                async with session.post(path + "/infer", data=payload, headers=headers) as response:
                    answer = await response.read()
                    if response.status == 200:
                        return ANSWERED
                    return STATUS_NAMES.get(response.status, f"HTTP_{response.status}"), error_message(answer)

            async def send(i: int, step: SequenceStep | None = None, caller: int = 0) -> Answer:
                try:
                    if step is not None:
                        return await post(*body(queries[i % len(queries)], sequence=step))
                    if not shared:
                        return await post(*bodies[i % len(bodies)])
                    with take() as regions:
                        return await post(*body(queries[i % len(queries)], regions, heads))
                except asyncio.TimeoutError:
                    return "DEADLINE_EXCEEDED", f"no answer within {timeout_s:g} s"
                except aiohttp.ClientError as error:
                    return "UNAVAILABLE", f"{type(error).__name__}: {error}"

            yield send


async def _drive(url: str, workload: Workload, point: Point, share: float, seed: int, timeout_s: float, tls, token):
    """This process's share of the point's load, sent for its warm-up and window; what the window measured."""
    sender = _http_sender if workload.protocol == "http" else _grpc_sender
    # This process's part of the connections, as its part of the load: at least one
    connections = max(1, round(workload.connections * share / point.load)) if workload.connections else 1
    async with sender(url, workload, seed, timeout_s, tls, token, connections) as send:
        drive = _Drive(send, point)
        marker = asyncio.create_task(drive.mark_window())
        if workload.sequence_length:
            await asyncio.gather(*(drive.grow_sequences(i, workload.sequence_length) for i in range(int(share))))
        elif point.mode == "closed":
            await asyncio.gather(*(drive.closed_loop(i) for i in range(int(share))))
        else:
            await drive.open_loop(share, seed, timeout_s)
        await marker
        cpu = cpu_seconds() - drive.cpu_at_start[0]
    return drive.result(cpu, steps=bool(workload.sequence_length))


class _Drive:
    """One client process's calls of a point: the window they are measured in, and what it measured."""

    def __init__(self, send, point: Point):
        self._send, self._point = send, point
        self.latencies: list[int] = []
        self.positions: list[int] = []  # sequences: the step position of each latency
        self.error_latencies: dict[str, list[int]] = {}
        self.error_details: dict[str, str] = {}
        self.cpu_at_start: list[float] = []
        self.behind_ns, self.dropped = 0, 0
        self.start = time.perf_counter_ns()
        self.measure_from = self.start + int(point.warmup_s * 1e9)
        # Where the window waits for the server's counters to be read, it ends NEVER until then
        self.end = self.measure_from + int(point.duration_s * 1e9) if _server_read is None else NEVER

    async def call(self, i: int, sent_ns: int, step: SequenceStep | None = None, position: int = 0, caller: int = 0):
        """One request, its latency kept where it was sent and answered within the window; returns its status."""
        status, details = await self._send(i, step, caller)
        done = time.perf_counter_ns()
        if sent_ns >= self.measure_from and done <= self.end:
            (self.latencies if status == "OK" else self.error_latencies.setdefault(status, [])).append(done - sent_ns)
            if status != "OK":
                self.error_details.setdefault(status, details)
            if status == "OK" and step is not None:
                self.positions.append(position)
        return status

    async def mark_window(self) -> None:
        await asyncio.sleep(max(0.0, (self.measure_from - time.perf_counter_ns()) / 1e9))
        _report_window("start")
        if _server_read is not None:  # the window starts once the server's counters are read: warm-up till then
            self.measure_from = self.end = NEVER
            await asyncio.get_running_loop().run_in_executor(None, _server_read.wait, SERVER_READ_WAIT_S)
            self.measure_from = time.perf_counter_ns()
            self.end = self.measure_from + int(self._point.duration_s * 1e9)
        self.cpu_at_start.append(cpu_seconds())
        await asyncio.sleep(max(0.0, (self.end - time.perf_counter_ns()) / 1e9))
        _report_window("end")

    async def grow_sequences(self, index: int, length: int) -> None:
        """Sequences one after another, one row a step; a refused step abandons its sequence."""
        i = index
        for n in itertools.count():
            name = f"bench-{os.getpid()}-{index}-{n}"
            for position in range(1, length + 1):
                if (now := time.perf_counter_ns()) >= self.end:
                    if position > 1:  # ended, so that it holds no memory on the server after the run
                        await self._send(i, SequenceStep(name, start=False, end=True), index)
                    return
                step = SequenceStep(name, start=position == 1, end=position == length)
                status = await self.call(i, now, step, position, index)
                i += 1
                if status != "OK":
                    break

    async def closed_loop(self, index: int) -> None:
        i = index
        while (now := time.perf_counter_ns()) < self.end:
            await self.call(i, now, caller=index)
            i += 1

    async def open_loop(self, rate: float, seed: int, timeout_s: float) -> None:
        """Requests sent at ``rate`` a second whether or not earlier ones were answered (up to
        OPEN_LOOP_MAX_OUTSTANDING; past it a send is dropped and counted)."""
        interval_ns = int(1e9 / rate)
        outstanding: set[asyncio.Task] = set()
        next_send = self.start + int(interval_ns * (seed % 997) / 997)  # processes out of phase
        i = 0
        while next_send < self.end:
            delay = next_send - time.perf_counter_ns()
            if delay > 0:
                await asyncio.sleep(delay / 1e9)
            elif next_send >= self.measure_from:
                self.behind_ns = max(self.behind_ns, -delay)
            if len(outstanding) >= OPEN_LOOP_MAX_OUTSTANDING:
                self.dropped += next_send >= self.measure_from
            else:
                task = asyncio.create_task(self.call(i, next_send, caller=i))
                outstanding.add(task)
                task.add_done_callback(outstanding.discard)
            i += 1
            next_send += interval_ns
        if outstanding:
            await asyncio.wait(outstanding, timeout=timeout_s)

    def result(self, cpu: float, steps: bool) -> WorkerResult:
        failed = {status: np.asarray(values, dtype=np.int64) for status, values in self.error_latencies.items()}
        positions = np.asarray(self.positions, dtype=np.int64) if steps else None
        return WorkerResult(np.asarray(self.latencies, dtype=np.int64), failed, cpu, self.behind_ns / 1e6,
                            self.dropped, positions, self.error_details)  # fmt: skip


_window_marks = None  # in a client process: where it says that its measured window starts and ends
_server_read = None  # in a client process: set once the server's counters are read at the window's start
SERVER_READ_WAIT_S = 30.0  # past this a window starts without the read
NEVER = 2**63 - 1  # perf_counter_ns() of a window not started yet


def _start_client_process(marks, server_read) -> None:
    global _window_marks, _server_read
    _window_marks, _server_read = marks, server_read


def _report_window(edge: str) -> None:
    if _window_marks is not None:
        _window_marks.put(edge)


def run_worker(
    url: str, workload: Workload, point: Point, share: float, seed: int, timeout_s: float, tls=None, token=None
) -> WorkerResult:
    """One client process's part of a point (runs in a child process)."""
    return asyncio.run(_drive(url, workload, point, share, seed, timeout_s, tls, token))


def summarize(point: Point, workload: Workload, parts: list[WorkerResult]) -> PointResult:
    latencies = np.concatenate([p.latencies_ns for p in parts]) / 1e6 if parts else np.zeros(0)
    statuses = sorted({status for part in parts for status in part.error_latencies_ns})
    refused = {s: np.concatenate([p.error_latencies_ns.get(s, np.zeros(0)) for p in parts]) / 1e6 for s in statuses}
    errors = {status: int(values.size) for status, values in refused.items()}
    error_latency = {
        status: {"p50": float(np.percentile(v, 50)), "p99": float(np.percentile(v, 99)), "max": float(v.max())}
        for status, v in refused.items()
    }
    if latencies.size:
        latency = {f"p{q:g}": float(np.percentile(latencies, q)) for q in PERCENTILES}
        latency |= {"max": float(latencies.max()), "mean": float(latencies.mean())}
    else:
        latency = {k: float("nan") for k in (*(f"p{q:g}" for q in PERCENTILES), "max", "mean")}
    cpu_cores = sum(p.cpu_s for p in parts) / point.duration_s
    # A client process near a full core cannot send faster: the figures then measure the client.
    client_bound = any(p.cpu_s / point.duration_s > 0.85 for p in parts) or max(p.behind_ms for p in parts) > 50
    by_position = None
    if workload.sequence_length:
        by_position = steps_by_position(np.concatenate([p.positions for p in parts]), latencies,
                                        workload.sequence_length)  # fmt: skip
    return PointResult(
        point=point,
        workload=workload,
        processes=len(parts),
        count=int(latencies.size),
        throughput=latencies.size / point.duration_s,
        latency_ms=latency,
        errors=errors,
        error_latency_ms=error_latency,
        client_cpu_cores=cpu_cores,
        client_bound=client_bound,
        behind_ms=max(p.behind_ms for p in parts),
        dropped=sum(p.dropped for p in parts),
        latencies_ms=latencies,
        by_position=by_position,
        error_details={s: next((p.error_details[s] for p in parts if s in p.error_details), "") for s in statuses},
    )


def position_ranges(length: int) -> list[tuple[int, int]]:
    """The ranges of step positions a sequence's figures are given for: 1-16, 17-128, 129-512, then x4, to length."""
    bounds = [16, 128, 512]
    while bounds[-1] < length:
        bounds.append(bounds[-1] * 4)
    ranges, low = [], 1
    for high in [b for b in bounds if b < length] + [length]:
        ranges.append((low, high))
        low = high + 1
    return ranges


def steps_by_position(positions: np.ndarray, latencies_ms: np.ndarray, length: int) -> dict:
    """Steps, p50 and p99 per range of positions: how a step's time grows as its sequence does."""
    figures = {}
    for low, high in position_ranges(length):
        inside = latencies_ms[(positions >= low) & (positions <= high)]
        figures[f"{low}-{high}"] = {
            "steps": int(inside.size),
            "p50": float(np.percentile(inside, 50)) if inside.size else None,
            "p99": float(np.percentile(inside, 99)) if inside.size else None,
        }
    return figures


def shares(point: Point, processes: int) -> list[float]:
    """Split a point's load over client processes: whole callers for closed loop, rate for open loop."""
    if point.mode == "closed":
        count = min(processes, int(point.load))
        base, extra = divmod(int(point.load), count)
        return [base + (i < extra) for i in range(count)]
    return [point.load / processes] * processes


class LoadGenerator:
    """A pool of client processes, reused across points (each costs ~0.5 s to start)."""

    def __init__(
        self,
        url: str,
        processes: int,
        timeout_s: float = 60.0,
        tls=None,
        token: str | None = None,
        counters: Callable[[], dict] | None = None,
    ):
        """``counters``: reads the server's statistics (server_side.counters_of), for the server's side of each
        point; None: the client's side only."""
        self.url = url
        self.tls, self.token = tls, token
        self.processes = processes
        self.timeout_s = timeout_s
        self._counters = counters
        # spawn, not fork: gRPC's threads do not survive a fork.
        context = multiprocessing.get_context("spawn")
        self._window_marks = context.Queue()  # each client process says when its window starts and ends
        self._server_read = context.Event() if counters is not None else None
        self._pool = ProcessPoolExecutor(
            processes,
            mp_context=context,
            initializer=_start_client_process,
            initargs=(self._window_marks, self._server_read),
        )

    def measure(self, workload: Workload, point: Point) -> PointResult:
        while not self._window_marks.empty():  # a previous point's, if it ended early
            self._window_marks.get_nowait()
        if self._server_read is not None:
            self._server_read.clear()
        futures = [
            self._pool.submit(run_worker, self.url, workload, point, share, 1 + i, self.timeout_s, self.tls, self.token)
            for i, share in enumerate(shares(point, self.processes))
        ]
        reads = None
        if self._counters is not None:
            longest_s = point.warmup_s + point.duration_s + SERVER_READ_WAIT_S
            reads = WindowReads(self._counters, self._window_marks, len(futures), longest_s, self._server_read)
        result = summarize(point, workload, [f.result() for f in futures])
        if reads is not None:
            result.server = reads.result(result.latency_ms.get("mean") if result.count else None)
            result.server_unread = reads.unread
        return result

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def default_processes() -> int:
    """Client processes: one per core this client may use (its affinity and CPU quota), four at most."""
    return min(4, usable_cores())
