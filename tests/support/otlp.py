"""An OTLP trace receiver made from opentelemetry-proto's generated service (no collector binary can be installed
here): the spans a server exports over OTLP gRPC or OTLP HTTP/protobuf, as plain records."""

from __future__ import annotations

import http.server
import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict
    links: list[tuple[str, str]]  # (trace id, span id)
    status_code: int
    events: list[tuple[str, int, dict]]  # (name, time, attributes)
    service: str = ""

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[Span]:
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for s in scope_spans.spans:
                spans.append(
                    Span(
                        s.name,
                        s.trace_id.hex(),
                        s.span_id.hex(),
                        s.parent_span_id.hex(),
                        s.kind,
                        s.start_time_unix_nano,
                        s.end_time_unix_nano,
                        {a.key: _value(a.value) for a in s.attributes},
                        [(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                        s.status.code,
                        [(e.name, e.time_unix_nano, {a.key: _value(a.value) for a in e.attributes}) for e in s.events],
                        resource.get("service.name", ""),
                    )
                )
    return spans


@dataclass
class OtlpReceiver:
    """Spans received, on 127.0.0.1; ``endpoint`` is what OTEL_EXPORTER_OTLP_ENDPOINT takes."""

    protocol: str  # "grpc" or "http/protobuf"
    spans: list[Span] = field(default_factory=list)
    endpoint: str = ""

    def __post_init__(self):
        self._lock = threading.Lock()
        if self.protocol == "grpc":
            self._server = grpc.server(futures.ThreadPoolExecutor(2))
            receiver = self

            class Service(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request, context):
                    receiver._add(spans_of(request))
                    return trace_service_pb2.ExportTraceServiceResponse()

            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
            port = self._server.add_insecure_port("127.0.0.1:0")
            self._server.start()
            self.endpoint = f"http://127.0.0.1:{port}"
        else:
            receiver = self

            class Handler(http.server.BaseHTTPRequestHandler):
                def do_POST(self):
                    body = self.rfile.read(int(self.headers["Content-Length"]))
                    request = trace_service_pb2.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    receiver._add(spans_of(request))
                    answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", str(len(answer)))
                    self.end_headers()
                    self.wfile.write(answer)

                def log_message(self, *args):
                    pass

            self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
            threading.Thread(target=self._server.serve_forever, daemon=True).start()
            self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def _add(self, spans: list[Span]) -> None:
        with self._lock:
            self.spans.extend(spans)

    def named(self, name: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.name == name]

    def wait_for(self, name: str, count: int, timeout: float = 20.0) -> list[Span]:
        deadline = time.monotonic() + timeout
        while len(self.named(name)) < count:
            assert time.monotonic() < deadline, f"{len(self.named(name))} spans named {name!r}, waited for {count}"
            time.sleep(0.05)
        return self.named(name)

    def close(self) -> None:
        if self.protocol == "grpc":
            self._server.stop(0)
        else:
            self._server.shutdown()
