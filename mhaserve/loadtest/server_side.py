"""The server's side of a load test's point: its statistics (Triton's statistics extension, which it serves
over both protocols) read when the client processes have started their measured window and when they have
ended it, and what the requests completed in between cost it on average: queue, compute (input, infer,
output), its whole time, and the rows of its runs. What the client measured beyond the server's time is the
transport's and the client's. Where the server checks its answers (live parity), the checks of the window too:
checked, breached and dropped, read once the checks offered in it are made."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

STAGES = ("queue", "compute_input", "compute_infer", "compute_output")
SPLIT_FIELDS = (
    "requests",
    "server_ms",
    *(f"{stage}_ms" for stage in STAGES),
    "rows_per_run",
    "transport_and_client_ms",
)


def counters_of(client) -> Callable[[], dict]:
    """A function reading ``client``'s model's statistics as a plain dict (the extension's fields; protobuf's
    JSON writes 64-bit integers as strings, which ``split`` reads as integers)."""
    from google.protobuf import json_format

    def read() -> dict:
        stats = client.statistics(timeout=10)
        if isinstance(stats, dict):  # over HTTP/REST: JSON already
            return stats
        return json_format.MessageToDict(stats, preserving_proto_field_name=True)

    return read


def split(before: dict, after: dict, client_mean_ms: float | None) -> dict | None:
    """Per request completed between the two reads, in milliseconds; None when none completed."""
    stats_before, stats_after = before["inference_stats"], after["inference_stats"]

    def delta(stage: str, field: str) -> int:
        return int(stats_after.get(stage, {}).get(field, 0)) - int(stats_before.get(stage, {}).get(field, 0))

    requests = delta("success", "count")
    if requests <= 0:
        return None
    side = {"requests": requests, "server_ms": delta("success", "ns") / requests / 1e6}
    side.update({f"{stage}_ms": delta(stage, "ns") / requests / 1e6 for stage in STAGES})
    runs = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
    rows = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
    side["rows_per_run"] = rows / runs if runs > 0 else None
    side["transport_and_client_ms"] = None if client_mean_ms is None else client_mean_ms - side["server_ms"]
    if "parity" in after:
        side["parity"] = parity_between(before.get("parity", {}), after["parity"])
    return side


PARITY_COUNTS = ("checked", "breached", "dropped")
# How long the read at a window's end waits for the checks offered in it (live parity) to be made.
PARITY_WAIT_S = 10.0


def parity_between(before: dict, after: dict) -> dict:
    """The checks made between two reads of the statistics' ``parity``, and each output's largest error since the
    version loaded (a largest error cannot be split by window)."""
    counts = {name: int(after.get(name, 0)) - int(before.get(name, 0)) for name in PARITY_COUNTS}
    return {**counts, "worst_error": {name: float(e) for name, e in after.get("worst_error", {}).items()}}


def parity_of_run(sides: list[dict | None]) -> dict | None:
    """The points' checks added up (their windows'), with the latest read's largest errors; None where the server
    checked none of them (no live parity)."""
    checked = [side["parity"] for side in sides if side is not None and "parity" in side]
    if not checked:
        return None
    return {
        **{name: sum(p[name] for p in checked) for name in PARITY_COUNTS},
        "worst_error": checked[-1]["worst_error"],
    }


def parity_line(run: dict | None) -> str:
    if run is None:
        return "Live parity: the server checked none of these answers (serve with --parity-share to check them)"
    worst = ", ".join(f"{name} {error:.2g}" for name, error in sorted(run["worst_error"].items())) or "none yet"
    return (
        f"Live parity over the run: {run['checked']} answers checked against float64, {run['breached']} breached, "
        f"{run['dropped']} dropped (the checks behind); worst error since the version loaded: {worst}"
    )


class WindowReads:
    """Reads the counters when every client process has reached the start of its measured window, and again when
    every one has ended it (each says so on ``marks``), on a thread of its own. ``before_read`` (an event the
    client processes wait on) is set once the first read is done, so that their windows start after it: a read
    that came late would otherwise miss part of the window, or all of it. A process that started late (a loaded
    machine) may end its window before another starts: its end is counted when it comes, not lost. A failed read
    is tried again; what still fails is said in ``unread``."""

    TRIES = 3

    def __init__(self, read: Callable[[], dict], marks, clients: int, longest_s: float, before_read=None):
        self._read, self._marks, self._clients, self._longest_s = read, marks, clients, longest_s
        self._before_read = before_read
        self._seen: Counter[str] = Counter()
        self.before: dict | None = None
        self.after: dict | None = None
        self.unread: str | None = None  # why the server's side is missing, where it is
        self._thread = threading.Thread(target=self._run, name="server-statistics", daemon=True)
        self._thread.start()

    def _wait_for(self, edge: str) -> None:
        while self._seen[edge] < self._clients:
            self._seen[self._marks.get(timeout=self._longest_s + 60)] += 1

    def _read_tried(self) -> dict:
        for _ in range(self.TRIES - 1):
            try:
                return self._read()
            except Exception:
                time.sleep(0.1)
        return self._read()

    def _run(self) -> None:
        try:
            self._wait_for("start")
            try:
                self.before = self._read_tried()
            finally:
                if self._before_read is not None:
                    self._before_read.set()
            self._wait_for("end")
            self.after = self._read_tried()
            waited = time.monotonic() + PARITY_WAIT_S
            while int(self.after.get("parity", {}).get("pending", 0)) and time.monotonic() < waited:
                time.sleep(0.05)  # the window's checks still being made
                self.after = self._read_tried()
        except queue.Empty:
            self.unread = "a client process never said when its window " + ("ended" if self.before else "started")
        except Exception as error:  # the server's side is extra: the point stands without it
            self.unread = f"its statistics could not be read: {type(error).__name__}: {error}"

    def result(self, client_mean_ms: float | None) -> dict | None:
        self._thread.join()
        if self.before is None or self.after is None:
            return None
        side = split(self.before, self.after, client_mean_ms)
        if side is None:
            self.unread = "no request completed between the two reads"
        return side
