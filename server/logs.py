"""The server's log lines: text for people or JSON for log pipelines (``--log-format``), and the opt-in access
log, one line per inference request (``--access-log``, logger ``mhaserve.access``).

JSON is one object a line: time (UTC, ISO 8601), level, logger, message, and the request's or model's fields
where the line has them (model, version, request_id, caller, peer, protocol, status, bytes and times for the access
log, trace_id for a traced request).
Lines that ONNX Runtime and gRPC's core print themselves (to stderr, not through Python's logging) stay as
they print them.
"""

from __future__ import annotations

import datetime
import logging
import sys

import orjson

from .statistics import RequestTiming

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
FORMATS = ("text", "json")
ACCESS = logging.getLogger("mhaserve.access")
# What a line may carry beside its message (``extra=``), named as JSON gives them.
FIELDS = (
    "model", "version", "request_id", "caller", "peer", "protocol", "status", "rows", "bytes_in", "bytes_out",
    "queue_ms", "compute_ms", "total_ms", "trace_id",
)  # fmt: skip


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for field in FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                entry[field] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def formatter(log_format: str) -> logging.Formatter:
    """How a line is written in ``log_format`` (FORMATS)."""
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def configure(level: str, log_format: str, access_log: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)  # Python warnings become log lines, in the same format
    ACCESS.setLevel(logging.INFO if access_log else logging.WARNING)


def access_line(
    protocol: str, model: str, version: str, status: str, request_id: str, rows: int, bytes_in: int, bytes_out: int,
    timing: RequestTiming, trace_id: str = "", peer: str = "", caller: str = "",
) -> None:  # fmt: skip
    """One inference request's line in the access log, if it is on: ``peer`` its address, ``caller`` who it is
    (security.Callers: a token's holder or a certificate's name, never a token; "-" where callers are not told
    apart), as nginx logs $remote_addr and $remote_user."""
    if not ACCESS.isEnabledFor(logging.INFO):
        return
    fields = {
        "peer": peer or "-",
        "caller": caller or "-",
        "protocol": protocol,
        "model": model,
        "version": version,
        "status": status,
        "request_id": request_id,
        "rows": rows,
        "bytes_in": bytes_in,
        "bytes_out": bytes_out,
        "queue_ms": round(timing.queue_ns / 1e6, 3),
        "compute_ms": round(timing.infer_ns / 1e6, 3),
        "total_ms": round(timing.total_ns / 1e6, 3),
    }
    if trace_id:
        fields["trace_id"] = trace_id
    ACCESS.info(
        "%s %s/%s %s id=%r caller=%r peer=%s rows=%d in=%d out=%d queue_ms=%.3f compute_ms=%.3f total_ms=%.3f%s",
        protocol, model or "-", version or "-", status, request_id, fields["caller"], fields["peer"], rows, bytes_in,
        bytes_out,
        fields["queue_ms"], fields["compute_ms"], fields["total_ms"], f" trace_id={trace_id}" if trace_id else "",
        extra=fields,
    )  # fmt: skip
