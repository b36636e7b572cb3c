"""Load that checks its answers: the core of the soak, overload and fault runs (tests and scripts).

Every request is distinct (random lengths, some cross-attention, some masks, some without weights),
carries an id, and is remembered; a sample of answers is recomputed alone on an in-process ONNX
Runtime session of the same model file and compared. Statuses are counted by code, so "zero
unexpected errors" and "every accepted request answered correctly" are figures, not impressions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from mhaserve.client import TLS, AsyncClient, InferResult


@dataclass(frozen=True)
class Shapes:
    d_model: int
    min_len: int = 1
    max_len: int = 64
    max_batch: int = 2
    cross_fraction: float = 0.3  # requests with their own key/value of another length
    mask_fraction: float = 0.3  # requests with a key-padding mask
    no_weights_fraction: float = 0.3  # requests asking for the output only


@dataclass
class Call:
    """One request as sent: its inputs, and what came back."""

    query: np.ndarray
    key: np.ndarray | None
    value: np.ndarray | None
    mask: np.ndarray | None
    attn_weights: bool
    status: str = ""
    details: str = ""  # the server's message when refused
    latency_s: float = 0.0
    result: InferResult | None = None


def make_call(rng: np.random.Generator, shapes: Shapes) -> Call:
    b = int(rng.integers(1, shapes.max_batch + 1))
    lq = int(rng.integers(shapes.min_len, shapes.max_len + 1))
    query = rng.standard_normal((b, lq, shapes.d_model), dtype=np.float32)
    key = value = None
    lk = lq
    if rng.random() < shapes.cross_fraction:
        lk = int(rng.integers(shapes.min_len, shapes.max_len + 1))
        key = rng.standard_normal((b, lk, shapes.d_model), dtype=np.float32)
        value = rng.standard_normal((b, lk, shapes.d_model), dtype=np.float32)
    mask = None
    if rng.random() < shapes.mask_fraction:
        mask = rng.random((b, lk)) < 0.8
        mask[:, 0] = True
    return Call(query, key, value, mask, attn_weights=bool(rng.random() >= shapes.no_weights_fraction))


class Reference:
    """The model file run alone, in process, on the CPU: what each request's answer must be."""

    def __init__(self, model_dir: Path):
        from mhaserve.server.graphs import AttentionGraphs

        self.session = AttentionGraphs.open(Path(model_dir), "cpu", intra_op_threads=1)
        # A float16 model's answers round to float16 steps: merged with other requests, a value may land
        # one step away from the one computed alone (about 1e-3 at 1).
        self.rtol = 2 * float(np.finfo(np.float16).eps) if self.session.info.precision == "fp16" else 0.0

    def answer(self, call: Call) -> tuple[np.ndarray, np.ndarray]:
        key = call.query if call.key is None else call.key
        value = key if call.value is None else call.value
        b, lq, _ = call.query.shape
        lk = key.shape[1]
        mask = np.ones((1, 1, 1, lk), dtype=bool) if call.mask is None else call.mask[:, None, None, :].astype(bool)
        output, weights = self.session.run(["output", "attn_weights"], call.query, key, value, mask)
        return output, weights


def mismatch(call: Call, reference: Reference, atol: float = 1e-4) -> str | None:
    """None when ``call``'s answer equals the reference (within ``atol`` plus the reference's rtol); else what
    differs."""
    want_out, want_attn = reference.answer(call)
    got = call.result
    if got.output is None or got.output.shape != want_out.shape:
        return f"output shape {None if got.output is None else got.output.shape}, expected {want_out.shape}"
    error = float(np.max(np.abs(got.output - want_out) - reference.rtol * np.abs(want_out)))
    if error > atol:
        return f"output differs by {error:.3g}"
    if call.attn_weights:
        if got.attn_weights is None or got.attn_weights.shape != want_attn.shape:
            return f"attn_weights shape {getattr(got.attn_weights, 'shape', None)}, expected {want_attn.shape}"
        error = float(np.max(np.abs(got.attn_weights - want_attn) - reference.rtol * np.abs(want_attn)))
        if error > atol:
            return f"attn_weights differ by {error:.3g}"
    elif got.attn_weights is not None:
        return "attn_weights returned though not requested"
    return None


@dataclass
class LoadReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    latencies_s: dict[str, list[float]] = field(default_factory=dict)  # by status
    rss_samples_mib: list[float] = field(default_factory=list)

    def add(self, call: Call) -> None:
        self.requests += 1
        self.statuses[call.status] += 1
        self.latencies_s.setdefault(call.status, []).append(call.latency_s)

    def latency_ms(self, status: str, q: float) -> float:
        values = self.latencies_s.get(status)
        return float(np.percentile(values, q) * 1000) if values else float("nan")

    def summary(self) -> str:
        statuses = ", ".join(f"{code} {n}" for code, n in sorted(self.statuses.items()))
        lines = [
            f"requests {self.requests} in {self.elapsed_s:.1f} s ({self.requests / max(self.elapsed_s, 1e-9):.0f}/s): "
            f"{statuses}",
            f"answers checked against the reference: {self.checked}, mismatches {len(self.mismatches)}",
        ]
        for status in sorted(self.latencies_s):
            p50, p99, top = (self.latency_ms(status, q) for q in (50, 99, 100))
            lines.append(f"latency {status}: p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {top:.1f} ms")
        if self.rss_samples_mib:
            first, last, peak = self.rss_samples_mib[0], self.rss_samples_mib[-1], max(self.rss_samples_mib)
            lines.append(
                f"server RSS after warm-up {first:.0f} MiB, at the end {last:.0f} MiB "
                f"(growth {last - first:+.0f} MiB), peak {peak:.0f} MiB"
            )
        return "\n".join(lines)


def _status_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {key} for pid {pid}")


def rss_mib(pid: int) -> float:
    """Resident memory of a process on this machine (Linux /proc)."""
    return _status_mib(pid, "VmRSS")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of a process on this machine, its threads and its child processes (a server's
    worker processes, live parity's check processes), those that have ended included (Linux /proc)."""
    ticks = 0
    for each in _with_children(pid):
        with contextlib.suppress(OSError):  # a child that ended meanwhile: its time is its parent's now
            fields = Path(f"/proc/{each}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += sum(int(field) for field in fields[11:15])  # utime, stime, and the ended children's
    return ticks / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    """The most resident memory the process has had since it started or since ``reset_peak_rss``: with its child
    processes' (a server's worker processes), the sum of their peaks."""
    return sum(_status_mib(each, "VmHWM") for each in _with_children(pid))


def reset_peak_rss(pid: int) -> None:
    """Start ``peak_rss_mib`` again from the process's (and its children's) resident memory now."""
    for each in _with_children(pid):
        Path(f"/proc/{each}/clear_refs").write_text("5")


def _with_children(pid: int) -> list[int]:
    """The process and the processes it started, and theirs (Linux /proc: each thread's own children)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += (task / "children").read_text().split()
    return [pid, *(each for child in children for each in _with_children(int(child)))]


async def send(client: AsyncClient, call: Call, timeout_s: float, sent_at: float | None = None) -> None:
    """Make ``call`` and fill in its status, details, result and latency (from ``sent_at`` when given)."""
    started = time.perf_counter() if sent_at is None else sent_at
    try:
        call.result = await client.infer(
            call.query, call.key, call.value, call.mask, call.attn_weights, timeout=timeout_s
        )
        call.status = "OK"
    except grpc.aio.AioRpcError as error:
        call.status, call.details = error.code().name, error.details() or ""
    call.latency_s = time.perf_counter() - started


async def run_checked_load(
    url: str,
    shapes: Shapes,
    requests: int,
    concurrency: int,
    reference: Reference | None = None,
    check_every: int = 50,
    timeout_s: float = 60.0,
    seed: int = 0,
    rss: Callable[[], float] | None = None,
    rss_after: int | None = None,
    tls: TLS | None = None,
    token: str | None = None,
) -> LoadReport:
    """``requests`` calls from ``concurrency`` callers on one channel; every ``check_every``-th OK answer
    (and the first) is compared with ``reference``. ``rss`` is sampled once ``rss_after`` requests are
    done (the warm-up) and then every tenth of the run."""
    report = LoadReport()
    rng = np.random.default_rng(seed)
    sent = 0
    rss_after = requests // 10 if rss_after is None else rss_after
    rss_step = max(1, (requests - rss_after) // 10)
    ok_seen = 0

    async with AsyncClient(url, tls=tls, token=token) as client:

        async def caller() -> None:
            nonlocal sent, ok_seen
            while sent < requests:
                sent += 1
                call = make_call(rng, shapes)
                await send(client, call, timeout_s)
                report.add(call)
                if call.status == "OK":
                    if reference is not None and ok_seen % check_every == 0:
                        report.checked += 1
                        problem = mismatch(call, reference)
                        if problem:
                            report.mismatches.append(problem)
                    ok_seen += 1
                done = report.requests
                if rss is not None and done >= rss_after and (done - rss_after) % rss_step == 0:
                    report.rss_samples_mib.append(rss())

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(concurrency)))
        report.elapsed_s = time.perf_counter() - started
    if rss is not None:
        report.rss_samples_mib.append(rss())
    return report


async def burst(
    url: str,
    calls: list[Call],
    timeout_s: float = 60.0,
    rate: float | None = None,
    tls: TLS | None = None,
    token: str | None = None,
) -> LoadReport:
    """Send every call at once, or ``rate`` per second on schedule (open loop), on one channel, and wait
    for all: the overload pattern. Latency counts from the scheduled send time."""
    report = LoadReport()
    async with AsyncClient(url, tls=tls, token=token) as client:
        await client.ready(timeout=30)

        async def one(call: Call, at: float) -> None:
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await send(client, call, timeout_s, sent_at=at)

        started = time.perf_counter()
        interval = 1 / rate if rate else 0.0
        await asyncio.gather(*(one(call, started + i * interval) for i, call in enumerate(calls)))
        report.elapsed_s = time.perf_counter() - started
    for call in calls:
        report.add(call)
    return report


def _send_until_stopped(url: str, message: bytes, stop, refusals, max_message_bytes: int) -> None:
    with grpc.insecure_channel(url, options=[("grpc.max_send_message_length", max_message_bytes)]) as channel:
        infer = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
        while not stop.is_set():
            try:
                infer(message, timeout=30)
            except grpc.RpcError as error:
                refusals.put(error.code().name)


def health_latencies_under_load(
    url: str,
    message: bytes | None,
    seconds: float,
    *,
    senders: int = 3,
    settle_s: float = 1.0,
    max_message_bytes: int = 64 << 20,
) -> tuple[list[float], list[str]]:
    """grpc.health.v1 Check round trips (seconds), one every 20 ms for ``seconds``, while ``senders`` processes
    send ``message`` (a serialised ModelInferRequest; None: no traffic) as fast as they are answered, after
    ``settle_s`` of that traffic; and the status names of the sends that were refused.

    The senders are processes of their own (spawned: no fork of a process that has used gRPC), so this one
    only checks and its latencies are the server's, not this interpreter's.
    """
    import multiprocessing
    import queue

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    spawn = multiprocessing.get_context("spawn")
    stop, refusals = spawn.Event(), spawn.Queue()
    processes = [
        spawn.Process(target=_send_until_stopped, args=(url, message, stop, refusals, max_message_bytes))
        for _ in range(senders if message is not None else 0)
    ]
    for process in processes:
        process.start()
    latencies = []
    with grpc.insecure_channel(url) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        check(health_pb2.HealthCheckRequest(), timeout=5)
        time.sleep(settle_s)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            started = time.perf_counter()
            check(health_pb2.HealthCheckRequest(), timeout=5)
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    stop.set()
    codes = []
    for process in processes:  # a process that put into the queue exits only once the queue is drained
        while process.is_alive() or not refusals.empty():
            try:
                codes.append(refusals.get(timeout=0.5))
            except queue.Empty:
                pass
        process.join(60)
    return latencies, codes
