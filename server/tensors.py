"""The protocol's tensor rules, for every transport: named arrays in, a validated RunInputs out.

Every check and every message about inputs lives here: which names, datatypes and shapes a request may
carry, how many bytes or values each holds, the limits, finiteness and the mask forms. A transport
(the protobuf codec, the REST one) only finds each tensor's name, datatype, shape and bytes or values
in its own wire format and hands them here, so a refusal reads the same over gRPC and HTTP.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from mhaserve.contract.datatypes import DATATYPES
from mhaserve.contract.signature import (
    DEFAULT_OUTPUT_NAMES,
    INPUT_NAMES,
    OUTPUT_NAMES,
    WEIGHTS_DATATYPES,
    ModelSignature,
)

from .config import flag_of
from .errors import ErrorKind, RequestError, invalid
from .parameters import NO_SHAPING, WeightsShaping


def weights_dtype(precision: str) -> np.dtype:
    """The dtype a model exported in ``precision`` returns its attention weights in."""
    return DATATYPES[WEIGHTS_DATATYPES[precision]]


MASK_DATATYPES = ("BOOL", "UINT8", "INT8", "INT32", "INT64")


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; beyond it the answer is RESOURCE_EXHAUSTED."""

    max_batch_size: int
    max_q_len: int
    max_kv_len: int
    set_by: str = ""  # the model's config.pbtxt, where it sets one of these (``configured``); else the server's flags
    configured: tuple[str, ...] = ()


@dataclass
class RunInputs:
    """What a run takes of a request (inference.InferenceRequest, the one request type), checked against its model
    and limits: its arrays ready for the ONNX graph, and the outputs and weights' shaping it asked for (set by the
    runtime that takes it, which knows over how many keys)."""

    query: np.ndarray  # [B, Lq, d] float32
    key: np.ndarray  # [B, Lk, d] float32 (query itself for self-attention)
    value: np.ndarray  # [B, Lk, d] float32
    mask: np.ndarray  # [B|1, 1, Lq|1, Lk] bool; all True when the request had none
    outputs: tuple[str, ...]  # requested outputs, in the order to return them
    shaping: WeightsShaping = NO_SHAPING  # what the request asked of the weights' outputs
    attended: int | None = None  # the keys it attends over where they are not all in it (a step: its cache too)

    @property
    def batch_size(self) -> int:
        return self.query.shape[0]

    @property
    def kv_len(self) -> int:
        return self.key.shape[1] if self.attended is None else self.attended


def _shape_text(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def check_input_header(name: str, datatype: str, seen) -> None:
    """A known input, given once, in a datatype it may have."""
    if name not in INPUT_NAMES:
        raise invalid(f"unknown input '{name}'; this model takes {', '.join(INPUT_NAMES)}")
    if name in seen:
        raise invalid(f"input '{name}' is given more than once")
    allowed_types = MASK_DATATYPES if name == "mask" else ("FP32",)
    if datatype not in allowed_types:
        why = ""
        if name == "mask" and datatype.startswith(("FP", "BF")):
            # PyTorch's float masks are added to the scores (0 attends, -inf does not): read as 0 = may not attend,
            # one would mean its opposite
            why = " (a float mask is not read: 0 means may not attend here, while PyTorch adds a float attn_mask)"
        raise invalid(f"input '{name}': datatype '{datatype}', expected {' or '.join(allowed_types)}{why}")


def element_count(name: str, shape) -> int:
    shape = tuple(shape)
    if any(d < 0 for d in shape):
        raise invalid(f"input '{name}': shape {_shape_text(shape)} has a negative dimension")
    count = math.prod(shape)
    if count == 0:  # and before numpy sees it: [0, 2^63-1, 512] holds nothing, yet is "too big" to reshape
        raise invalid(
            f"input '{name}': shape {_shape_text(shape)} holds no elements; every dimension must be at least 1"
        )
    return count


def byte_count(name: str, datatype: str, shape) -> int:
    """The bytes a tensor of this datatype and shape holds."""
    return element_count(name, shape) * DATATYPES[datatype].itemsize


def array_from_bytes(name: str, datatype: str, shape, raw, where: str = "raw contents") -> np.ndarray:
    """The tensor from its little-endian bytes, without a copy (read-only)."""
    dtype = DATATYPES[datatype]
    expected = byte_count(name, datatype, shape)
    if len(raw) != expected:
        raise invalid(
            f"input '{name}': {len(raw)} bytes of {where}, expected {expected} ({datatype} {_shape_text(shape)})"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(tuple(shape))


def array_from_values(name: str, datatype: str, shape, values, where: str) -> np.ndarray:
    """The tensor from a flat sequence of values (protobuf's typed contents, JSON's data)."""
    count = element_count(name, shape)
    dtype = DATATYPES[datatype]
    if len(values) != count:
        raise invalid(
            f"input '{name}': {len(values)} values in {where}, expected {count} ({datatype} {_shape_text(shape)})"
        )
    if dtype.kind in "iu" and dtype.itemsize < 8 and len(values):
        # Integers arrive wider than INT8/UINT8/INT32 hold, and numpy would raise (or wrap).
        wide = converted(values, np.int64)
        info = np.iinfo(dtype)
        low, high = int(wide.min()), int(wide.max())
        if low < info.min or high > info.max:
            bad = low if low < info.min else high
            raise invalid(
                f"input '{name}': value {bad} in {where} is out of range for {datatype} [{info.min}, {info.max}]"
            )
        return wide.astype(dtype).reshape(tuple(shape))
    return converted(values, dtype).reshape(tuple(shape))


# Values per conversion call: one call over millions of values holds the interpreter for a visible pause
# (BENCHMARKS.md, "Figures behind the server's defaults").
CONVERT_CHUNK = 1 << 16


def converted(values, dtype) -> np.ndarray:
    """``np.asarray(values, dtype)`` for a sequence converted value by value, a chunk per call, so that the
    thread doing it lets the event loop run between chunks."""
    if len(values) <= CONVERT_CHUNK or isinstance(values, np.ndarray):
        return np.asarray(values, dtype=dtype)
    out = np.empty(len(values), dtype=dtype)
    for start in range(0, len(values), CONVERT_CHUNK):
        out[start : start + CONVERT_CHUNK] = values[start : start + CONVERT_CHUNK]
    return out


def checked_inputs(arrays: dict[str, np.ndarray], output_names, model: ModelSignature, limits: Limits) -> RunInputs:
    """Named input arrays checked against the model and the limits; RequestError on the first problem."""
    query = arrays.get("query")
    if query is None:
        raise invalid("input 'query' is missing; it is required ([batch, q_len, d_model] FP32)")
    batch, q_len = _check_sequence(query, "query", model.d_model, batch=None)
    key, value = arrays.get("key"), arrays.get("value")
    if key is None and value is not None:
        raise invalid("input 'value' is given without 'key'; give both, only 'key', or neither (self-attention)")
    if key is None:
        key = value = query
        kv_len = q_len
    else:
        _, kv_len = _check_sequence(key, "key", model.d_model, batch=batch)
        if value is None:
            value = key
        else:
            _check_sequence(value, "value", model.d_model, batch=batch, length=(kv_len, "the length of 'key'"))

    for tensor, what, size, limit in (
        ("query", "batch", batch, "max_batch_size"),
        ("query", "q_len", q_len, "max_q_len"),
        ("key", "kv_len", kv_len, "max_kv_len"),
    ):
        if size > getattr(limits, limit):
            set_by = f"the server's {flag_of(limit)} raises it"
            if limit in limits.configured:
                set_by = f"set by {limits.set_by}"
            raise RequestError(
                ErrorKind.RESOURCE_EXHAUSTED,
                f"input '{tensor}': {what} {size} exceeds the limit {limit}={getattr(limits, limit)} ({set_by})",
            )
    checked = []
    for name in ("query", "key", "value"):
        array = arrays.get(name)
        if array is not None and not any(array is seen for seen in checked):  # self-attention: one check
            masks_bound = model.mask_exact_input_limit is not None and name != "value"  # values make no scores
            if model.max_abs_input is not None or masks_bound:
                largest = max(float(array.max()), -float(array.min()))  # NaN or Inf where any value is
                if not math.isfinite(largest):
                    _check_finite(array, name)
                if model.max_abs_input is not None:
                    _check_validated_range(largest, name, model)
                if masks_bound:
                    _check_mask_exact_range(largest, name, model.mask_exact_input_limit)
            else:
                _check_finite(array, name)
            checked.append(array)

    mask = _attention_mask(arrays.get("mask"), batch, q_len, kv_len)
    return RunInputs(
        query=query,
        key=key,
        value=value,
        mask=mask,
        outputs=requested_outputs(output_names),
    )


def _check_sequence(array, name, d_model, batch, length=None) -> tuple[int, int]:
    if array.ndim != 3:
        raise invalid(f"input '{name}': shape {_shape_text(array.shape)}, expected rank 3 [batch, length, {d_model}]")
    b, n, d = array.shape
    if d != d_model:
        raise invalid(f"input '{name}': shape {_shape_text(array.shape)}, last dim {d}, expected d_model {d_model}")
    if b == 0 or n == 0:
        raise invalid(f"input '{name}': shape {_shape_text(array.shape)}, batch and length must be at least 1")
    if batch is not None and b != batch:
        raise invalid(f"input '{name}': batch {b}, expected {batch} (the batch of 'query')")
    if length is not None and n != length[0]:
        raise invalid(f"input '{name}': length {n}, expected {length[0]} ({length[1]})")
    return b, n


def count_non_finite(array: np.ndarray) -> int:
    """How many NaN or Inf ``array`` holds. Any poisons a sum, which needs no temporary array; only a
    non-finite sum (a bad value, or finite values overflowing float32) pays for the exact count."""
    with np.errstate(over="ignore", invalid="ignore"):
        # float16 weights sum to B * h * Lq, past float16's largest value: summed in float32.
        if np.isfinite(array.sum(dtype=np.float32 if array.dtype == np.float16 else None)):
            return 0
    return int(array.size - np.count_nonzero(np.isfinite(array)))


def _check_finite(array: np.ndarray, name: str) -> None:
    bad = count_non_finite(array)
    if bad:
        raise invalid(f"input '{name}': {bad} non-finite values (NaN or Inf); expected finite FP32 values")


def _check_validated_range(largest: float, name: str, model: ModelSignature) -> None:
    if largest > model.max_abs_input:
        raise invalid(
            f"input '{name}': values up to {largest:.6g} in magnitude; this {model.precision} export of model "
            f"'{model.name}' was validated for inputs up to {model.max_abs_input:.6g} and would not answer accurately "
            "past it; scale the inputs down, or serve a float32 export"
        )


def _check_mask_exact_range(largest: float, name: str, limit: float) -> None:
    if largest > limit:
        raise invalid(
            f"input '{name}': values up to {largest:.6g} in magnitude; past {limit:.6g} this model's query-key scores "
            "could overflow float32 where a mask no longer decides (a masked key could take the weight); scale the "
            "inputs down"
        )


def _attention_mask(mask: np.ndarray | None, batch: int, q_len: int, kv_len: int) -> np.ndarray:
    """The served rank-4 bool mask [B|1, 1, Lq|1, Lk] from [B, Lk] or [B, Lq, Lk] (0 = may not attend)."""
    if mask is None:
        return _unmasked(kv_len)
    expected = f"[{batch}, {kv_len}] (key padding) or [{batch}, {q_len}, {kv_len}]"
    if mask.ndim == 2 and mask.shape[0] in (1, batch) and mask.shape[1] == kv_len:
        allowed = mask[:, None, None, :]
    elif mask.ndim == 3 and mask.shape[0] in (1, batch) and mask.shape[1:] == (q_len, kv_len):
        allowed = mask[:, None, :, :]
    else:
        raise invalid(f"input 'mask': shape {_shape_text(mask.shape)}, expected {expected}")
    if allowed.dtype != np.bool_:
        return allowed != 0
    # Raw BOOL bytes are whatever the client sent: any nonzero byte means true, as for integer masks. Left
    # as they are, ONNX Runtime's Cast took 0x02 as 2.0 (rows summing to 2) and 0xFF as NaN, with status OK.
    as_bytes = allowed.view(np.uint8)
    return as_bytes != 0 if (as_bytes > 1).any() else allowed


@functools.lru_cache(maxsize=1024)
def _unmasked(kv_len: int) -> np.ndarray:
    """The shared, read-only [1, 1, 1, Lk] all-True mask of requests without one (a fresh one per request
    was a tenth of decoding at [1,16,512])."""
    mask = np.ones((1, 1, 1, kv_len), dtype=bool)
    mask.flags.writeable = False
    return mask


def requested_outputs(output_names) -> tuple[str, ...]:
    names = tuple(output_names)
    for name in names:
        if name not in OUTPUT_NAMES:
            raise invalid(f"unknown requested output '{name}'; this model returns {', '.join(OUTPUT_NAMES)}")
    if len(set(names)) != len(names):
        raise invalid(f"requested outputs {list(names)} name an output more than once")
    return names or DEFAULT_OUTPUT_NAMES


def wire_bytes(array: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes as they go on the wire, without a copy (an empty array: no bytes; memoryview
    cannot cast a view with a zero in its shape)."""
    return memoryview(array).cast("B") if array.size else memoryview(b"")
