"""The served signature, stated once: the tensors clients send and may ask for, with datatypes and dims.

Torch-free: the server's codec, metadata and config, the batcher, the client and the exporter read it.
"""

from __future__ import annotations

from dataclasses import dataclass

QUERY, KEY, VALUE, MASK = "query", "key", "value", "mask"
OUTPUT, ATTN_WEIGHTS, ATTN_WEIGHTS_MEAN = "output", "attn_weights", "attn_weights_mean"

INPUT_NAMES = (QUERY, KEY, VALUE, MASK)
# What the ONNX graph computes. The mean over heads is the server's: one pass over the weights when a
# client asks for it, where a graph output would cost every run that pass (ONNX Runtime runs every node
# whichever outputs are fetched).
GRAPH_OUTPUT_NAMES = (OUTPUT, ATTN_WEIGHTS)
OUTPUT_NAMES = (OUTPUT, ATTN_WEIGHTS, ATTN_WEIGHTS_MEAN)
# What a request that names no outputs gets.
DEFAULT_OUTPUT_NAMES = (OUTPUT, ATTN_WEIGHTS)

# The precisions a model is exported in, and the datatype its attention weights are returned in. Every
# model takes FP32 inputs and returns an FP32 output; a float16 model returns its weights in float16,
# half the bytes of the largest tensor an answer holds (B * h * Lq * Lk values).
WEIGHTS_DATATYPES = {"fp32": "FP32", "fp16": "FP16"}
PRECISIONS = tuple(WEIGHTS_DATATYPES)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str  # the protocol's datatype
    shape: tuple[int, ...]  # -1: dynamic
    optional: bool = False


def input_specs(d_model: int) -> list[TensorSpec]:
    """What a request may carry: query [B, Lq, d]; key/value [B, Lk, d] (absent: self-attention);
    mask [B|1, Lq, Lk] (key padding [B|1, Lk] is accepted too), BOOL or integer, 0 = may not attend."""
    return [
        TensorSpec(QUERY, "FP32", (-1, -1, d_model)),
        TensorSpec(KEY, "FP32", (-1, -1, d_model), optional=True),
        TensorSpec(VALUE, "FP32", (-1, -1, d_model), optional=True),
        TensorSpec(MASK, "BOOL", (-1, -1, -1), optional=True),
    ]


def output_specs(d_model: int, num_heads: int, precision: str = "fp32") -> list[TensorSpec]:
    """What a request may ask for: the output [B, Lq, d], the weights [B, h, Lq, Lk] and their mean over
    heads [B, Lq, Lk] (as nn.MultiheadAttention returns by default; h times fewer bytes)."""
    weights = WEIGHTS_DATATYPES[precision]
    return [
        TensorSpec(OUTPUT, "FP32", (-1, -1, d_model)),
        TensorSpec(ATTN_WEIGHTS, weights, (-1, num_heads, -1, -1)),
        TensorSpec(ATTN_WEIGHTS_MEAN, weights, (-1, -1, -1)),
    ]


def graph_outputs_for(requested: tuple[str, ...]) -> tuple[str, ...]:
    """The graph outputs a run must fetch to answer ``requested`` (the mean is taken from the weights)."""
    needed = {*requested, ATTN_WEIGHTS} if ATTN_WEIGHTS_MEAN in requested else set(requested)
    return tuple(name for name in GRAPH_OUTPUT_NAMES if name in needed)
