"""What one span costs in the OpenTelemetry Python SDK, in process: a bare span, one with the server's
attributes, one with a request's five phase events, and a traced request's whole span as the server makes it
(attributes at start, the request's, events, the end's), as child spans instead of events, and with the
attributes alone; the last three include OTLP encoding (what the batch exporter's thread does with each span).

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_span_cost.py [--rounds 3] [--spans 3000]

Prints microseconds per span, median of the rounds. Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

SERVER = {"rpc.system": "grpc", "rpc.service": "inference.GRPCInferenceService", "rpc.method": "ModelInfer",
          "mhaserve.protocol": "grpc", "mhaserve.model.name": "mha", "mhaserve.model.version": "1"}  # fmt: skip
REQUEST = {"mhaserve.request.query_shape": [1, 16, 512], "mhaserve.request.key_shape": [1, 16, 512],
           "mhaserve.request.outputs": ["output", "attn_weights"]}  # fmt: skip
END = {"mhaserve.status": "OK", "mhaserve.request.rows": 1, "mhaserve.decode_ms": 0.1, "mhaserve.queue_ms": 0.2,
       "mhaserve.infer_ms": 1.0, "mhaserve.encode_ms": 0.1, "mhaserve.send_ms": 0.3, "mhaserve.response.bytes": 1000,
       "rpc.grpc.status_code": 0}  # fmt: skip
PHASES = ("decoded", "queued", "run started", "run ended", "encoded")


class Discard(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


class EncodeOnly(SpanExporter):
    """OTLP's encoding of every span, as the OTLP exporters do before sending."""

    def export(self, spans):
        encode_spans(spans).SerializeToString()
        return SpanExportResult.SUCCESS


def tracer_with(exporter: SpanExporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # in the caller's thread: all of it is timed
    return provider.get_tracer("bench")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spans", type=int, default=3000)
    args = parser.parse_args()
    plain, encoded = tracer_with(Discard()), tracer_with(EncodeOnly())
    now = time.time_ns()

    def bare():
        plain.start_span("s", start_time=now).end(end_time=now)

    def attributed():
        plain.start_span("s", attributes=SERVER, start_time=now).end(end_time=now)

    def with_events():
        span = plain.start_span("s", start_time=now)
        for name in PHASES:
            span.add_event(name, timestamp=now)
        span.end(end_time=now)

    def request_span_with_events():
        span = encoded.start_span("s", kind=trace.SpanKind.SERVER, attributes=SERVER, start_time=now)
        span.set_attributes(REQUEST)
        for name in PHASES:
            span.add_event(name, timestamp=now)
        span.set_attributes(END)
        span.end(end_time=now)

    def request_span_with_children():
        span = encoded.start_span("s", kind=trace.SpanKind.SERVER, attributes=SERVER, start_time=now)
        span.set_attributes(REQUEST)
        parent = trace.set_span_in_context(span)
        for name in ("decode", "queue", "infer", "encode", "send"):
            encoded.start_span(name, context=parent, start_time=now).end(end_time=now)
        span.set_attributes(END)
        span.end(end_time=now)

    def request_span_attributes_only():
        span = encoded.start_span("s", kind=trace.SpanKind.SERVER, attributes=SERVER, start_time=now)
        span.set_attributes({**REQUEST, **END})
        span.end(end_time=now)

    cases = {
        "bare span": bare,
        "6 attributes": attributed,
        "5 events": with_events,
        "request span, events (served), +encoding": request_span_with_events,
        "request span, 5 child spans, +encoding": request_span_with_children,
        "request span, attributes only, +encoding": request_span_attributes_only,
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, case in cases.items():
            for _ in range(args.spans // 10):
                case()
            started = time.perf_counter()
            for _ in range(args.spans):
                case()
            times[name].append((time.perf_counter() - started) / args.spans * 1e6)
    for name, values in times.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"{name:>42}: {statistics.median(values):6.1f} us ({rounds})")


if __name__ == "__main__":
    main()
