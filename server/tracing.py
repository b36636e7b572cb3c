"""Request tracing with OpenTelemetry, and Triton's trace extension (the TraceSetting RPC, /v2/trace/setting).

Settings are Triton's: ``trace_level`` (OFF or TIMESTAMPS), ``trace_rate`` (one request in every N is traced; 0:
only those whose caller's trace is sampled),
``trace_count`` (traces left to take; -1: no end), each global or per model, changed at run time by TraceSetting
behind the token. A request that arrives with a W3C ``traceparent`` saying "sampled" is traced whatever the rate
(OpenTelemetry's parent-based sampling), and its span is the child of the client's.

A traced request is one server span (named and attributed by OpenTelemetry's RPC or HTTP conventions) with an
event at each boundary of its phases (decoded, queued, run started, run ended, encoded; the span ends when the
answer is sent) and each phase's duration as an attribute; every batched run that served a traced request is one
span of its own, linked to each traced request span it served, with its rows, lengths and padded share. Spans
are made from the timestamps the request's bookkeeping takes anyway, at the request's end, so a traced request
costs its span and nothing more, and an untraced one a counter. With tracing off the
OpenTelemetry SDK is never imported: it comes with the ``tracing`` extra and is imported when tracing is first on.

Export is OTLP, configured by OpenTelemetry's own environment variables (``OTEL_EXPORTER_OTLP_ENDPOINT``,
``OTEL_EXPORTER_OTLP_PROTOCOL`` grpc or http/protobuf, ``OTEL_BSP_*``, ``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``); ``--trace-config opentelemetry,url=...`` sets the endpoint as Triton's does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import grpc

import mhaserve

from .errors import HTTP_STATUS, ErrorKind, RequestError, invalid
from .trace_settings import SETTABLE, TraceSettings, checked_settings

if TYPE_CHECKING:
    from mhaserve.contract.signature import ModelSignature

    from .calls import CallRecord
    from .statistics import BatchResult
    from .tensors import RunInputs

log = logging.getLogger("mhaserve.server")

GRPC_SERVICE = "inference.GRPCInferenceService"


class TracingUnavailable(Exception):
    """Tracing asked for, without the OpenTelemetry SDK or with an export it does not have."""


class Tracing:
    """The process's trace settings (global, and what each model overrides), the sampling, and the
    OpenTelemetry tracer, made when tracing is first on."""

    def __init__(self, settings: TraceSettings, endpoint: str | None = None):
        self._global = settings
        self._overrides: dict[str, dict[str, object]] = {}  # per model: the fields it sets itself
        self._counters: dict[str, int] = {}  # requests seen per model
        self._endpoint = endpoint
        self._tracer = None
        self._provider = None
        self._lock = threading.Lock()
        self.active = False  # some model may be traced: the one check an untraced request pays
        self._refresh()

    def _settings(self, model: str) -> TraceSettings:
        overrides = self._overrides.get(model)
        return replace(self._global, **overrides) if overrides else self._global

    def _refresh(self) -> None:
        scopes = [self._global, *(self._settings(m) for m in self._overrides)]
        active = any(s.level != "OFF" and s.count != 0 for s in scopes)
        if active and self._tracer is None:
            self._tracer, self._provider = _make_tracer(self._endpoint)
        self.active = active

    # -- Triton's trace extension ------------------------------------------------------------------------

    def settings_of(self, model: str = "") -> dict[str, list[str]]:
        return self._settings(model).as_protocol()

    def update(self, model: str, changes: Mapping[str, Sequence[str] | None]) -> dict[str, list[str]]:
        """TraceSetting's update, by Triton's names: a setting given values takes them; one given none goes back
        to the global one (for a model) or its default (globally). Refused as a whole (INVALID_ARGUMENT, or
        FAILED_PRECONDITION when tracing cannot be turned on)."""
        current = self._settings(model)
        fallback = self._global if model else TraceSettings()
        cleared = [n.removeprefix("trace_") for n, v in changes.items() if not v and n in SETTABLE]
        current = replace(current, **{field: getattr(fallback, field) for field in cleared})
        try:
            updated = checked_settings(current, {name: values for name, values in changes.items() if values})
        except ValueError as error:
            raise invalid(str(error)) from None
        previous = self._global, {m: dict(o) for m, o in self._overrides.items()}
        if model:
            overrides = self._overrides.setdefault(model, {})
            for field in cleared:
                overrides.pop(field, None)
            for name in changes:
                if changes[name] and name in SETTABLE:
                    field = name.removeprefix("trace_")
                    overrides[field] = getattr(updated, field)
        else:
            self._global = updated
        self._counters.clear()
        try:
            self._refresh()
        except TracingUnavailable as error:
            self._global, self._overrides = previous
            raise RequestError(ErrorKind.FAILED_PRECONDITION, f"cannot turn tracing on: {error}") from None
        return self.settings_of(model)

    # -- requests ----------------------------------------------------------------------------------------

    def begin(self, call: CallRecord, signature: ModelSignature) -> RequestTrace | None:
        """Whether ``call`` is traced (its parent's flag, else its model's rate and count), and if so its
        server span, started when the call started."""
        name = signature.name
        settings = self._settings(name)
        if settings.level == "OFF" or settings.count == 0:
            return None
        headers = call.headers() if call.headers is not None else {}
        traceparent = headers.get("traceparent")
        with self._lock:
            seen = self._counters.get(name, 0)
            self._counters[name] = seen + 1
            if not (_parent_sampled(traceparent) or (settings.rate and seen % settings.rate == 0)):
                return None
            if settings.count > 0:  # one trace fewer to take, where the count is set
                overrides = self._overrides.get(name)
                if overrides is not None and "count" in overrides:
                    overrides["count"] = settings.count - 1
                else:
                    self._global = replace(self._global, count=self._global.count - 1)
                if settings.count == 1:
                    self._refresh()
        return RequestTrace(self._tracer, call, signature, headers if traceparent else None)

    def shutdown(self, timeout_s: float) -> None:
        """Export what is left (the batch processor's queue) for at most ``timeout_s``: an OTLP endpoint that
        never answers must not hold the stop past its grace period (the exporter would wait out its own timeout,
        and retry). What is not exported by then is dropped, and said."""
        if self._provider is None:
            return
        flush = threading.Thread(target=self._provider.shutdown, name="otlp-flush", daemon=True)
        flush.start()
        flush.join(timeout_s)
        if flush.is_alive():
            log.warning(
                "tracing: the spans not exported within %.1f s of the stop were dropped (the OTLP endpoint did not "
                "answer in time)",
                timeout_s,
            )


def _parent_sampled(traceparent: str | None) -> bool:
    """W3C trace context: version-traceid-parentid-flags, bit 0 of flags "sampled"."""
    if not traceparent:
        return False
    parts = traceparent.strip().split("-")
    try:
        return len(parts) >= 4 and len(parts[1]) == 32 and bool(int(parts[3][:2], 16) & 1)
    except ValueError:
        return False


def _make_tracer(endpoint: str | None):
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise TracingUnavailable("the OpenTelemetry SDK is not installed: pip install 'mhaserve[tracing]'") from None
    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    )  # fmt: skip
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise TracingUnavailable(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: expected grpc or http/protobuf")
    except ImportError:
        raise TracingUnavailable(
            f"the OTLP {protocol} exporter is not installed: pip install 'mhaserve[tracing]'"
        ) from None
    if endpoint and "://" not in endpoint:
        endpoint = "http://" + endpoint
    attributes = {"service.version": mhaserve.__version__}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "mhaserve"
    # Not at the interpreter's exit: the stop flushes within its grace period (Tracing.shutdown).
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint) if endpoint else
                                                   OTLPSpanExporter()))  # fmt: skip
    log.info("tracing: OpenTelemetry spans exported over OTLP %s to %s", protocol, endpoint or "the OTEL_* endpoint")
    return provider.get_tracer("mhaserve", mhaserve.__version__), provider


class _Clock:
    """Turns perf_counter_ns readings into nanoseconds since the epoch, as spans are stamped: one offset for every
    span (so the spans of one run line up exactly), read again each minute (the wall clock may be slewed)."""

    def __init__(self):
        self.offset, self._read_at = 0, -1e18

    def now_offset(self) -> int:
        now = time.perf_counter_ns()
        if now - self._read_at > 60e9:
            self.offset, self._read_at = time.time_ns() - time.perf_counter_ns(), now
        return self.offset


_CLOCK = _Clock()


class RequestTrace:
    """One traced request: its server span, open from the call's start, and its children, made at its end."""

    __slots__ = ("_tracer", "span", "_offset", "_http")

    def __init__(self, tracer, call: CallRecord, signature: ModelSignature, carrier: Mapping | None):
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._tracer = tracer
        self._offset = _CLOCK.now_offset()
        self._http = call.protocol == "http"
        parent = TraceContextTextMapPropagator().extract(carrier) if carrier is not None else None
        if self._http:
            name = f"POST {call.method}"
            attributes = {"http.request.method": "POST", "http.route": call.method}
        else:
            method = call.method or "ModelInfer"
            name = f"{GRPC_SERVICE}/{method}"
            attributes = {"rpc.system": "grpc", "rpc.service": GRPC_SERVICE, "rpc.method": method}
        attributes.update(
            {
                "mhaserve.protocol": call.protocol,
                "mhaserve.model.name": signature.name,
                "mhaserve.model.version": signature.version,
            }
        )
        self.span = tracer.start_span(
            name, context=parent, kind=trace.SpanKind.SERVER, attributes=attributes,
            start_time=call.started + self._offset,
        )  # fmt: skip

    @property
    def trace_id(self) -> str:
        return format(self.span.get_span_context().trace_id, "032x")

    def decoded(self, request: RunInputs, request_id: str) -> None:
        attributes = {
            "mhaserve.request.query_shape": list(request.query.shape),
            "mhaserve.request.key_shape": list(request.key.shape),
            "mhaserve.request.outputs": list(request.outputs),
        }
        if request_id:
            attributes["mhaserve.request.id"] = request_id
        self.span.set_attributes(attributes)

    def finish(self, call: CallRecord, status: str, ended_ns: int) -> None:
        """The call's phases from its timestamps (events at their boundaries, durations as attributes: measured
        cheaper than child spans, BENCHMARKS.md "Tracing"), its status, and its end."""
        span, offset, timing = self.span, self._offset, call.timing
        decoded = call.started + timing.input_ns
        span.add_event("decoded", timestamp=decoded + offset)
        attributes = {"mhaserve.status": status, "mhaserve.request.rows": call.rows,
                      "mhaserve.decode_ms": timing.input_ns / 1e6}  # fmt: skip
        if call.run_started_ns:
            run_start = call.run_started_ns
            span.add_event("queued", timestamp=run_start - timing.queue_ns + offset)
            span.add_event("run started", {"mhaserve.batch.rows": call.run_rows}, timestamp=run_start + offset)
            span.add_event("run ended", timestamp=run_start + timing.infer_ns + offset)
            attributes["mhaserve.queue_ms"] = timing.queue_ns / 1e6
            attributes["mhaserve.infer_ms"] = timing.infer_ns / 1e6
        if call.encoded_ns:
            span.add_event("encoded", timestamp=call.encoded_ns + offset)
            attributes["mhaserve.encode_ms"] = timing.output_ns / 1e6
            if status == "OK" or call.bytes_out:
                attributes["mhaserve.send_ms"] = (ended_ns - call.encoded_ns) / 1e6
                attributes["mhaserve.response.bytes"] = call.bytes_out
        if self._http:
            code = 200 if status == "OK" else HTTP_STATUS.get(ErrorKind.__members__.get(status))
            if code is not None:
                attributes["http.response.status_code"] = code
            failed = code is not None and code >= 500
        else:
            code = grpc.StatusCode[status].value[0] if status in grpc.StatusCode.__members__ else 2
            attributes["rpc.grpc.status_code"] = code
            failed = status in ("UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS")
        span.set_attributes(attributes)
        if failed:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, status))
        span.end(end_time=ended_ns + offset)


def record_run(result: BatchResult, requests: Sequence[RunInputs], traces: Sequence[RequestTrace]) -> None:
    """One batched run that served traced requests: a span of its own, linked to each of their spans."""
    from opentelemetry import context, trace

    first = traces[0]
    span = first._tracer.start_span(
        "model run",
        context=context.Context(),  # a root: the run belongs to every request it served, no one's trace
        links=[trace.Link(t.span.get_span_context()) for t in traces],
        attributes={
            "mhaserve.batch.requests": len(requests),
            "mhaserve.batch.rows": result.batch_size,
            "mhaserve.batch.q_len": result.q_len,
            "mhaserve.batch.kv_len": result.kv_len,
            "mhaserve.batch.q_lens": [r.query.shape[1] for r in requests],
            "mhaserve.batch.kv_lens": [r.key.shape[1] for r in requests],
            "mhaserve.batch.padding_ratio": result.padding_ratio,
            "mhaserve.run.merge_ns": result.merge_ns,
            "mhaserve.run.model_ns": result.model_ns,
            "mhaserve.run.split_ns": result.split_ns,
            **{k: v for k, v in first.span.attributes.items() if k.startswith("mhaserve.model.")},
        },
        start_time=result.started_ns + first._offset,
    )
    span.end(end_time=result.finished_ns + first._offset)
