"""Triton's trace settings (``--trace-config`` at start, the TraceSetting RPC at run time): what they hold and
how each is checked. Plain values, read by the configuration and by tracing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from .parameters import quoted

LEVELS = ("OFF", "TIMESTAMPS")
# Triton's settings that do not apply to OpenTelemetry export (trace files); accepted as Triton reports them.
FILE_SETTINGS = ("trace_file", "log_frequency")
SETTABLE = ("trace_level", "trace_rate", "trace_count")
UINT32_MAX, INT32_MAX = 2**32 - 1, 2**31 - 1


@dataclass(frozen=True)
class TraceSettings:
    level: str = "OFF"
    rate: int = 1000
    count: int = -1

    def as_protocol(self) -> dict[str, list[str]]:
        """As Triton's TraceSetting answers: every value a list of strings."""
        return {
            "trace_level": [self.level],
            "trace_rate": [str(self.rate)],
            "trace_count": [str(self.count)],
            "trace_mode": ["opentelemetry"],
            "trace_file": [""],
            "log_frequency": ["0"],
        }


def parse_trace_config(entries: Sequence[str]) -> tuple[TraceSettings, str | None]:
    """``--trace-config`` as Triton takes it, repeatable: ``mode=opentelemetry``, ``level=OFF|TIMESTAMPS``,
    ``rate=N``, ``count=N``, ``opentelemetry,url=ENDPOINT`` (a section word before a comma is allowed). Naming the
    mode turns tracing on (level TIMESTAMPS) unless a level is given. Returns the global settings and the OTLP
    endpoint, if one was given. ValueError says what is wrong."""
    values: dict[str, str] = {}
    for entry in entries:
        if "=" not in entry:
            if entry.strip().lower() != "opentelemetry":
                raise ValueError(f"{entry!r}: expected KEY=VALUE, or the section 'opentelemetry'")
            continue
        key, value = (part.strip() for part in entry.split("=", 1))
        values[key.lower()] = value
    unknown = sorted(set(values) - {"mode", "level", "rate", "count", "url"})
    if unknown:
        raise ValueError(f"unknown setting(s) {unknown}: expected mode, level, rate, count or url")
    mode = values.get("mode", "opentelemetry").lower()
    if mode != "opentelemetry":
        raise ValueError(f"mode={mode}: this server traces with OpenTelemetry only (mode=opentelemetry)")
    default_level = "TIMESTAMPS" if "mode" in values or "url" in values else "OFF"
    settings = checked_settings(
        TraceSettings(),
        {
            name: [values[key]]
            for key, name in (("level", "trace_level"), ("rate", "trace_rate"), ("count", "trace_count"))
            if key in values
        },  # fmt: skip
    )
    if "level" not in values:
        settings = replace(settings, level=default_level)
    return settings, values.get("url")


def checked_settings(base: TraceSettings, changes: Mapping[str, Sequence[str]]) -> TraceSettings:
    """``base`` with Triton-named ``changes`` (trace_level, trace_rate, trace_count; trace_file and log_frequency
    accepted only as no file), or ValueError naming the setting, what it takes and what came."""
    settings = base
    for name, values in changes.items():
        value = values[-1] if values else ""
        if name == "trace_level":
            levels = [v.upper() for v in values]
            if not levels or any(v not in LEVELS for v in levels):
                raise ValueError(f"trace_level: expected OFF or TIMESTAMPS, got {quoted(list(values))}")
            settings = replace(settings, level="TIMESTAMPS" if "TIMESTAMPS" in levels else "OFF")
        elif name in ("trace_rate", "trace_count"):
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"{name}: expected an integer, got {quoted(value)}") from None
            # Triton's ranges: the rate is a uint32, the count an int32.
            if name == "trace_rate" and not 0 <= number <= UINT32_MAX:
                raise ValueError(
                    f"trace_rate: expected 0..{UINT32_MAX} (one request in every N; 0: none), got {number}"
                )
            if name == "trace_count" and not -1 <= number <= INT32_MAX:
                raise ValueError(f"trace_count: expected -1 (no end) or 0..{INT32_MAX}, got {number}")
            settings = replace(settings, **{name.removeprefix("trace_"): number})
        elif name in FILE_SETTINGS:
            if value not in ("", "0"):
                raise ValueError(f"{name}: trace files are not written here (traces are exported over OTLP)")
        elif name == "trace_mode":
            if value.lower() != "opentelemetry":
                raise ValueError(f"trace_mode: this server traces with OpenTelemetry only, got {quoted(value)}")
        else:
            raise ValueError(
                f"unknown trace setting {quoted(name)}: expected trace_level, trace_rate, trace_count, trace_mode, "
                "trace_file or log_frequency"
            )
    return settings
