"""The protocol's datatypes and their numpy dtypes, in one table that client and server both read."""

from __future__ import annotations

import numpy as np

DATATYPES = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "INT8": np.dtype(np.int8),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
NUMPY_TO_DATATYPE = {dtype: name for name, dtype in DATATYPES.items()}


def datatype_of(array: np.ndarray) -> str:
    try:
        return NUMPY_TO_DATATYPE[array.dtype]
    except KeyError:
        raise ValueError(f"no protocol datatype for numpy dtype {array.dtype}") from None
