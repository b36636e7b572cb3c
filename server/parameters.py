"""Request parameters read by type, whatever the transport carried, and what they say: a request's place in a
sequence (``sequence_parameters``) and the shaping it asks of the attention weights (``weights_shaping``).

A value of any other JSON or protobuf type (a list, an object, a bool where a number goes, text that is no
number) is refused as INVALID_ARGUMENT naming the parameter, what it takes and what came; no parsing error
reaches the generic handler. A client's value is quoted clipped (``quoted``): an error message travels back in
gRPC trailers, whose size is limited, and a log line should not carry a client's 20 KB.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from mhaserve.contract.errors import json_kind
from mhaserve.contract.signature import (
    ATTN_TOP_K_INDICES,
    ATTN_TOP_K_VALUES,
    OUTPUT,
    SHAPING_PARAMETERS,
    WEIGHTS_OUTPUT_NAMES,
    window_ends,
)

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


def described(value: object) -> str:
    """What came, for a refusal: its kind in JSON's words and the value, "a string 'yes'"."""
    return "null" if value is None else f"{_kind(value)} {quoted(value)}"


def _kind(value: object) -> str:
    """The value's type in the words of JSON, with its article: "an integer", "a string", "null"."""
    kind = json_kind(value)
    return kind if value is None else f"{'an' if kind[0] in 'aeiou' else 'a'} {kind}"


@dataclass(frozen=True)
class SequenceParameters:
    """What a request's sequence parameters say."""

    id: int | str
    start: bool
    end: bool
    # The rows of keys and values the sequence holds before this step, where the client says (``sequence_position``):
    # a step resent after its answer was lost is then refused rather than applied twice.
    position: int | None = None


def request_timeout_us(parameters: Mapping[str, object]) -> int:
    """Triton's request ``timeout`` parameter (tritonclient's ``infer(timeout=)``), in microseconds; 0: none."""
    value = parameters.get("timeout")
    return 0 if value is None else integer(value, "timeout", 0, UINT64_MAX, "microseconds")


def request_priority(parameters: Mapping[str, object]) -> int:
    """Triton's request ``priority`` parameter (tritonclient's ``infer(priority=)``), a level; 0: none named."""
    value = parameters.get("priority")
    return 0 if value is None else integer(value, "priority", 0, UINT64_MAX, "a priority level, 1 first")


def sequence_parameters(parameters: Mapping[str, object]) -> SequenceParameters | None:
    """The request's place in a sequence, or None for a request outside any (no id, or id 0 / "" as Triton's
    clients send for none)."""
    sequence_id = parameters.get("sequence_id")
    start = boolean(parameters.get("sequence_start", False), "sequence_start")
    end = boolean(parameters.get("sequence_end", False), "sequence_end")
    position = parameters.get("sequence_position")
    if position is not None:
        position = integer(position, "sequence_position", 0, UINT64_MAX, "the rows the sequence holds before the step")
    # Only integers and strings are ids: false and 0.0 equal 0 in Python, and would pass for "no sequence".
    if sequence_id is not None and (isinstance(sequence_id, bool) or not isinstance(sequence_id, int | str)):
        raise invalid(
            f"parameter 'sequence_id' must be an integer or a string, got {_kind(sequence_id)} {quoted(sequence_id)}"
        )
    if sequence_id in (None, 0, ""):
        if start or end or position is not None:
            raise invalid(
                "parameters 'sequence_start'/'sequence_end'/'sequence_position' need a 'sequence_id' (a non-zero "
                "integer or a string)"
            )
        return None
    if isinstance(sequence_id, int) and not 0 < sequence_id <= UINT64_MAX:
        raise invalid(f"parameter 'sequence_id' must be an unsigned 64-bit integer, got {sequence_id}")
    if isinstance(sequence_id, str) and len(sequence_id) > 256:
        raise invalid(f"parameter 'sequence_id' must be at most 256 characters, got {len(sequence_id)}")
    if start and position not in (None, 0):
        raise invalid(f"parameter 'sequence_position': a sequence's first step is at position 0, got {position}")
    return SequenceParameters(sequence_id, start, end, position)


TOP_K_OUTPUTS = (ATTN_TOP_K_VALUES, ATTN_TOP_K_INDICES)
ASKABLE_WEIGHTS_DTYPES = {"FP32": np.dtype(np.float32), "FP16": np.dtype(np.float16)}  # attn_weights_precision


@dataclass(frozen=True)
class WeightsShaping:
    """What a request asked of the weights; None everywhere: the full weights, as the model returns them."""

    heads: tuple[int, ...] | None = None
    rows: tuple[int, int] | None = None  # [start, stop) over query positions
    keys: tuple[int, int] | None = None  # [start, stop) over key positions
    top_k: int | None = None
    top_p: float | None = None
    dtype: np.dtype | None = None  # None: the model's own

    def selected_shape(self, batch: int, num_heads: int, q_len: int, kv_len: int) -> tuple[int, int, int, int]:
        """[B, h', Lq', Lk']: the weights after the head, row and key choices."""
        heads = len(self.heads) if self.heads is not None else num_heads
        rows = self.rows[1] - self.rows[0] if self.rows else q_len
        keys = self.keys[1] - self.keys[0] if self.keys else kv_len
        return batch, heads, rows, keys


NO_SHAPING = WeightsShaping()


def weights_shaping(
    parameters: Mapping[str, object], named: tuple[str, ...], num_heads: int, q_len: int, kv_len: int
) -> tuple[WeightsShaping, tuple[str, ...] | None]:
    """The request's shaping options, checked (INVALID_ARGUMENT naming the parameter otherwise), and the outputs
    it gets when it named none (None: the model's defaults)."""
    unknown = sorted(name for name in parameters if name.startswith("attn_") and name not in SHAPING_PARAMETERS)
    if unknown:
        raise invalid(
            f"unknown parameter {quoted(unknown[0])}; the weights' options are {', '.join(SHAPING_PARAMETERS)}"
        )
    given = [name for name in SHAPING_PARAMETERS if name in parameters]
    top_k_named = [name for name in named if name in TOP_K_OUTPUTS]
    if not given:
        return NO_SHAPING, None
    heads = _heads(parameters.get("attn_heads"), num_heads)
    rows = _window(parameters.get("attn_rows"), "attn_rows", q_len, "query rows")
    keys = _window(parameters.get("attn_keys"), "attn_keys", kv_len, "key positions")
    window = keys[1] - keys[0] if keys else kv_len
    top_k = _top_k(parameters.get("attn_top_k"), window)
    top_p = _top_p(parameters.get("attn_top_p"))
    if top_k is not None and top_p is not None:
        raise invalid("parameters attn_top_k and attn_top_p were both given; a request asks for one of them")
    dtype = _precision(parameters.get("attn_weights_precision"))
    shaping = WeightsShaping(heads, rows, keys, top_k, top_p, dtype)
    ranked = top_k is not None or top_p is not None
    if named:
        weights_named = [name for name in named if name in WEIGHTS_OUTPUT_NAMES]
        if not weights_named:
            raise invalid(
                f"parameter '{given[0]}' shapes the attention weights, but the request asks for none of the "
                f"weights' outputs ({', '.join(WEIGHTS_OUTPUT_NAMES)}); it named {', '.join(named)}"
            )
        if ranked and not top_k_named:
            which = "attn_top_k" if top_k is not None else "attn_top_p"
            raise invalid(f"parameter '{which}' needs the output {ATTN_TOP_K_VALUES} or {ATTN_TOP_K_INDICES}")
        return shaping, None
    return shaping, (OUTPUT, *TOP_K_OUTPUTS) if ranked else None


def _heads(value, num_heads: int) -> tuple[int, ...] | None:
    if value is None:
        return None
    given = text(value, "attn_heads")
    try:
        heads = tuple(int(part) for part in given.split(","))
    except ValueError:
        raise invalid(f"parameter 'attn_heads' must list head numbers like \"0,3\", got {quoted(given)}") from None
    for head in heads:
        if not 0 <= head < num_heads:
            raise invalid(
                f"parameter 'attn_heads': head {head} is out of range; this model has heads 0..{num_heads - 1}"
            )
    if len(set(heads)) != len(heads):
        raise invalid(f"parameter 'attn_heads' names a head more than once: {quoted(given)}")
    return heads


def _window(value, name: str, length: int, what: str) -> tuple[int, int] | None:
    """A Python-style "start:stop" range (either end may be left out, negative counts from the end), non-empty
    and within the request's ``length``."""
    if value is None:
        return None
    given = text(value, name).strip()
    try:
        start, stop = window_ends(given)
    except ValueError:
        raise invalid(f"parameter '{name}' must be a range like \"0:32\" (start:stop), got {quoted(given)}") from None
    start, stop = 0 if start is None else start, length if stop is None else stop
    start, stop = (index + length if index < 0 else index for index in (start, stop))
    if not 0 <= start < stop <= length:
        raise invalid(
            f"parameter '{name}': {quoted(given)} is no non-empty range of the request's {length} {what} (0..{length})"
        )
    return start, stop


def _top_k(value, window: int) -> int | None:
    if value is None:
        return None
    return integer(value, "attn_top_k", 1, window, "the keys each row has to rank")


def _top_p(value) -> float | None:
    if value is None:
        return None
    return number(value, "attn_top_p", 0, 1, low_open=True)


def _precision(value) -> np.dtype | None:
    if value is None:
        return None
    given = text(value, "attn_weights_precision").upper()
    if given not in ASKABLE_WEIGHTS_DTYPES:
        raise invalid(f"parameter 'attn_weights_precision' must be FP32 or FP16, got {quoted(value)}")
    return ASKABLE_WEIGHTS_DTYPES[given]
