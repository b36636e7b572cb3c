"""The server's log lines: text for people or JSON for log pipelines (``--log-format``), and the opt-in access
log, one line per inference request (``--access-log``, logger ``mhaserve.access``). Which lines are written, their
format and the access log can be changed while the server runs, by Triton's logging extension (LogSettings,
``/v2/logging``): LogSwitches.

JSON is one object a line: time (UTC, ISO 8601), level, logger, message, and the request's or model's fields
where the line has them (model, version, request_id, caller, peer, protocol, status, bytes and times for the access
log, trace_id for a traced request).
Lines that ONNX Runtime and gRPC's core print themselves (to stderr, not through Python's logging) stay as
they print them.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import orjson

from .errors import invalid
from .parameters import described, quoted
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


@dataclass(frozen=True)
class LogSwitches:
    """Which lines the server writes and how, by the names of Triton's logging extension (and the access log):
    each severity on or off, verbose (DEBUG) lines at a level above 0, the format. Set at start from
    ``--log-level``, ``--log-format`` and ``--access-log``; changed while the server runs by ``updated``."""

    log_info: bool = True
    log_warning: bool = True
    log_error: bool = True
    log_verbose_level: int = 0
    log_format: str = "text"
    access_log: bool = False

    @classmethod
    def from_flags(cls, level: str, log_format: str, access_log: bool) -> LogSwitches:
        """``--log-level`` as the severities it lets through: DEBUG all of them (verbose level 1), WARNING no INFO,
        ERROR neither INFO nor WARNING."""
        level = level.upper()
        return cls(log_info=level in ("DEBUG", "INFO"), log_warning=level != "ERROR",
                   log_verbose_level=int(level == "DEBUG"), log_format=log_format, access_log=access_log)  # fmt: skip

    def as_protocol(self) -> dict[str, object]:
        """As Triton's LogSettings answers: every setting, ``log_file`` empty (the lines go to stderr)."""
        return {"log_file": "", **dataclasses.asdict(self)}

    def updated(self, changes: Mapping[str, object]) -> LogSwitches:
        """These switches with ``changes`` (setting name to a bool, an integer or a string, as the protocols carry
        them), each checked first: a change that cannot be made refuses them all, naming the setting, what it
        takes and what came."""
        made = {}
        for name, value in changes.items():
            if name == "log_file":  # Triton's, as it answers: the lines go where the process's stderr goes
                if value != "":
                    raise invalid(
                        "log setting 'log_file' cannot be changed: the server writes its log to stderr (a container's "
                        f"log, or where serve's stderr is sent), got {described(value)}"
                    )
                continue
            if name not in LOG_SETTINGS:
                raise invalid(
                    f"unknown log setting {quoted(name)}: the settings are log_file, {', '.join(LOG_SETTINGS)}"
                )
            expected = LOG_SETTINGS[name]
            if expected is bool and not isinstance(value, bool):
                raise invalid(f"log setting '{name}' must be true or false, got {described(value)}")
            if expected is int and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32):
                # Triton's LogSettings carries it as a uint32: a larger one could not be answered over gRPC
                raise invalid(f"log setting '{name}' must be an integer from 0 to 2**32 - 1, got {described(value)}")
            if expected is str:
                value = "text" if value == "default" else value  # Triton's name for its default format
                if value not in FORMATS:
                    raise invalid(f"log setting '{name}' must be one of {', '.join(FORMATS)} (Triton's 'default' "
                                  f"reads as text), got {described(value)}")  # fmt: skip
            made[name] = value
        return dataclasses.replace(self, **made)


# What each setting takes, by name (log_file, fixed, apart).
LOG_SETTINGS = {
    field.name: {"bool": bool, "int": int, "str": str}[field.type] for field in dataclasses.fields(LogSwitches)
}


class _Switched(logging.Filter):
    """Lets through the lines the switches ask for: each severity by its own switch, as Triton's are (INFO off
    with WARNING on); the access log's lines by the access log's switch alone (its logger's level)."""

    def __init__(self):
        super().__init__()
        self.switches = LogSwitches()

    def filter(self, record: logging.LogRecord) -> bool:
        switches = self.switches
        if record.name == ACCESS.name:
            return True
        if record.levelno >= logging.ERROR:
            return switches.log_error
        if record.levelno >= logging.WARNING:
            return switches.log_warning
        if record.levelno >= logging.INFO:
            return switches.log_info
        return switches.log_verbose_level > 0


_switched = _Switched()
_handler: logging.Handler | None = None  # the process's, once configured


def configure(level: str, log_format: str, access_log: bool) -> None:
    """The process's log as the flags ask, its lines on stderr."""
    global _handler
    _handler = logging.StreamHandler(sys.stderr)
    _handler.addFilter(_switched)
    logging.basicConfig(handlers=[_handler], force=True)
    logging.captureWarnings(True)  # Python warnings become log lines, in the same format
    switch(LogSwitches.from_flags(level, log_format, access_log))


def switches() -> LogSwitches:
    return _switched.switches


def switch(to: LogSwitches) -> None:
    """The process's log as ``to`` says, from its next line."""
    if _handler is not None:
        _handler.setFormatter(formatter(to.log_format))
    _switched.switches = to
    # DEBUG lines are made only while verbose is on (a line the filter drops has cost its making already)
    logging.getLogger().setLevel(logging.DEBUG if to.log_verbose_level else logging.INFO)
    ACCESS.setLevel(logging.INFO if to.access_log else logging.WARNING)


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
