"""Request parameters read by type: one function per type, whatever the transport carried.

A value of any other JSON or protobuf type (a list, an object, a bool where a number goes, text that is no
number) is refused as INVALID_ARGUMENT naming the parameter, what it takes and what came; no parsing error
reaches the generic handler. A client's value is quoted clipped (``quoted``): an error message travels back in
gRPC trailers, whose size is limited, and a log line should not carry a client's 20 KB.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import invalid

UINT64_MAX = 2**64 - 1

QUOTED_AT_MOST = 100  # characters of a client's value an error message repeats


def quoted(value: object) -> str:
    """``repr(value)``, clipped to QUOTED_AT_MOST characters with its full length said."""
    text = repr(value)
    if len(text) <= QUOTED_AT_MOST:
        return text
    return f"{text[:QUOTED_AT_MOST]}... ({len(text)} characters)"


def text(value: object, name: str) -> str:
    """A string (an integer is taken as its digits: a client may send ``attn_heads`` 3 as a number)."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise invalid(f"parameter '{name}' must be a string, got {_kind(value)} {quoted(value)}")
    return str(value)


def integer(value: object, name: str, low: int, high: int, what: str = "") -> int:
    """An integer in [low, high]: a number without a fraction, or text of one."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    number = _read(value, int, int)
    if number is None:
        raise invalid(f"parameter '{name}' must be an integer, got {_kind(value)} {quoted(value)}")
    if not low <= number <= high:
        raise invalid(f"parameter '{name}': {number} is outside {low}..{high}{', ' + what if what else ''}")
    return number


def number(value: object, name: str, low: float, high: float, low_open: bool = False) -> float:
    """A finite number in [low, high] (or (low, high] with ``low_open``): a number, or text of one."""
    result = _read(value, int | float, float)
    span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
    if result is None or not math.isfinite(result):
        raise invalid(f"parameter '{name}' must be a number in {span}, got {_kind(value)} {quoted(value)}")
    if not (low < result if low_open else low <= result) or result > high:
        raise invalid(f"parameter '{name}' must be a number in {span}, got {result:g}")
    return result


def _read(value: object, kinds, convert):
    """``convert(value)`` for a value of ``kinds`` or text that converts; None for anything else (a bool too)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, kinds):
        return convert(value)
    if isinstance(value, str):
        try:
            return convert(value.strip())
        except ValueError:
            return None
    return None


def boolean(value: object, name: str) -> bool:
    """true or false: a JSON or protobuf bool (Triton's clients send these as bools)."""
    if not isinstance(value, bool):
        raise invalid(f"parameter '{name}' must be true or false, got {_kind(value)} {quoted(value)}")
    return value


def _kind(value: object) -> str:
    """The value's type in the words of JSON, which most clients write."""
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)  # fmt: skip


@dataclass(frozen=True)
class SequenceParameters:
    """What a request's sequence parameters say."""

    id: int | str
    start: bool
    end: bool


def sequence_parameters(parameters: Mapping[str, object]) -> SequenceParameters | None:
    """The request's place in a sequence, or None for a request outside any (no id, or id 0 / "" as Triton's
    clients send for none)."""
    sequence_id = parameters.get("sequence_id")
    start = boolean(parameters.get("sequence_start", False), "sequence_start")
    end = boolean(parameters.get("sequence_end", False), "sequence_end")
    # Only integers and strings are ids: false and 0.0 equal 0 in Python, and would pass for "no sequence".
    if sequence_id is not None and (isinstance(sequence_id, bool) or not isinstance(sequence_id, int | str)):
        raise invalid(
            f"parameter 'sequence_id' must be an integer or a string, got {_kind(sequence_id)} {quoted(sequence_id)}"
        )
    if sequence_id in (None, 0, ""):
        if start or end:
            raise invalid(
                "parameters 'sequence_start'/'sequence_end' need a 'sequence_id' (a non-zero integer or a string)"
            )
        return None
    if isinstance(sequence_id, int) and not 0 < sequence_id <= UINT64_MAX:
        raise invalid(f"parameter 'sequence_id' must be an unsigned 64-bit integer, got {sequence_id}")
    if isinstance(sequence_id, str) and len(sequence_id) > 256:
        raise invalid(f"parameter 'sequence_id' must be at most 256 characters, got {len(sequence_id)}")
    return SequenceParameters(sequence_id, start, end)
