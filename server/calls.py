"""What one inference call is, as the request's bookkeeping reads it: its transport, timing, size, status and
the version it resolved to. Facts only: the data plane's ``InferenceCall`` fills them in as the call goes, and
the accounting, the access log and tracing read them once it ends."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from .statistics import RequestTiming

ReadHeaders = Callable[[], Mapping[str, str]]  # the call's headers or metadata, read only if needed


class CallRecord:
    def __init__(
        self,
        protocol: str,
        timeout_s: float | None,
        method: str,
        headers: ReadHeaders | None,
        peer: str = "",
        caller: str = "",
    ):
        self.protocol = protocol  # what it is counted as: "grpc", "http", or a Ray replica's
        self.timeout_s = timeout_s  # the caller's deadline, if any
        self.method = method  # the RPC or the HTTP route
        self.headers = headers
        self.peer = peer  # the caller's address (shared memory is for callers on this host only)
        self.caller = caller  # who it comes from (security.Callers.identify): "" where callers are not told apart
        self.started = time.perf_counter_ns()
        self.timing = RequestTiming()
        self.rows = 0
        self.status = "UNKNOWN"
        self.shed_by = ""  # the bound of the server's that refused it, where one did (errors.SHED_REASONS)
        self.served = None  # the ServedModel (registry.py) it resolved to, once it did
        self.request_id = ""  # the protocol's request id, once decoded
        self.bytes_in = 0  # the request's bytes as received
        self.bytes_out = 0  # the answer's bytes as written
        self.trace = None  # a RequestTrace (tracing.py), if this call is traced
        self.run_started_ns = 0  # when the run it was in started
        self.run_rows = 0  # the rows of the run it was in
        self.encoded_ns = 0  # when its answer was encoded
        self.forwarded = False  # answered by the serving process that holds its sequence, which counts it
