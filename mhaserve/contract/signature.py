"""The served signature, stated once: the tensors clients send and may ask for, with datatypes and dims.

Torch-free: the server's codec, metadata and config, the batcher, the client and the exporter read it.
"""

from __future__ import annotations

from dataclasses import dataclass

QUERY, KEY, VALUE, MASK = "query", "key", "value", "mask"
OUTPUT, ATTN_WEIGHTS, ATTN_WEIGHTS_MEAN = "output", "attn_weights", "attn_weights_mean"
# The top-k (or top-p) keys of each query row: their weights, and their positions in the full key sequence.
ATTN_TOP_K_VALUES, ATTN_TOP_K_INDICES = "attn_weights_top_k_values", "attn_weights_top_k_indices"
# Per head and query row, over every key: the entropy of its weights (nats), the weight on the first key (the
# attention sink), and its largest weight and that key's position (-1 on a row that may attend no key).
ATTN_ENTROPY, ATTN_SINK = "attn_weights_entropy", "attn_weights_sink"
ATTN_MAX, ATTN_MAX_INDEX = "attn_weights_max", "attn_weights_max_index"
SUMMARY_OUTPUT_NAMES = (ATTN_ENTROPY, ATTN_SINK, ATTN_MAX, ATTN_MAX_INDEX)

INPUT_NAMES = (QUERY, KEY, VALUE, MASK)
# What the ONNX graph computes. The mean over heads is the server's: one pass over the weights when a
# client asks for it, where a graph output would cost every run that pass (ONNX Runtime runs every node
# whichever outputs are fetched).
GRAPH_OUTPUT_NAMES = (OUTPUT, ATTN_WEIGHTS)
OUTPUT_NAMES = (OUTPUT, ATTN_WEIGHTS, ATTN_WEIGHTS_MEAN, ATTN_TOP_K_VALUES, ATTN_TOP_K_INDICES, *SUMMARY_OUTPUT_NAMES)
# The outputs made from the weights, which a request's shaping parameters shape.
WEIGHTS_OUTPUT_NAMES = OUTPUT_NAMES[1:]
# The request parameters that shape them (server/shaping.py says what each does).
SHAPING_PARAMETERS = ("attn_heads", "attn_rows", "attn_keys", "attn_top_k", "attn_top_p", "attn_weights_precision")
# What a request that names no outputs gets.
DEFAULT_OUTPUT_NAMES = (OUTPUT, ATTN_WEIGHTS)


def window_ends(text: str) -> tuple[int | None, int | None]:
    """The ends of attn_rows' and attn_keys' Python-style "start:stop" range, either left out (None) and either
    negative (from the end); ValueError for any other form. The lengths it must fit are the request's."""
    parts = text.strip().split(":")
    if len(parts) != 2:
        raise ValueError(f'expected a range like "0:32" (start:stop), got {text!r}')
    try:
        start, stop = (int(part) if part.strip() else None for part in parts)
    except ValueError:
        raise ValueError(f'expected a range like "0:32" (start:stop), got {text!r}') from None
    return start, stop


# The precisions a model is exported in, and the datatype its attention weights are returned in. Every
# model takes FP32 inputs and returns an FP32 output; a float16 model returns its weights in float16,
# half the bytes of the largest tensor an answer holds (B * h * Lq * Lk values).
WEIGHTS_DATATYPES = {"fp32": "FP32", "fp16": "FP16", "int8": "FP32"}
PRECISIONS = tuple(WEIGHTS_DATATYPES)
# What each precision's graph computes in, as the model's config and the server's start-up line say it.
COMPUTES_IN = {
    "fp32": "float32",
    "fp16": "float16 value path (V projection, weighted sum, W_o); float32 attention weights",
    "int8": "int8 projections W_q, W_k, W_v, W_o (inputs per token, weights per output column); float32 scores, "
    "softmax and weighted sum",
}


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
    """What a request may ask for: the output [B, Lq, d], the weights [B, h, Lq, Lk], their mean over heads
    [B, Lq, Lk] (as nn.MultiheadAttention returns by default; h times fewer bytes), each query row's top-k
    keys, weights and positions [B, h, Lq, k], and each query row's summaries [B, h, Lq] (entropy, sink weight,
    largest weight and its key). A request's shaping parameters choose heads, rows and keys (so the heads dim is
    h or fewer) and may return the weights in FP16."""
    weights = WEIGHTS_DATATYPES[precision]
    return [
        TensorSpec(OUTPUT, "FP32", (-1, -1, d_model)),
        TensorSpec(ATTN_WEIGHTS, weights, (-1, -1, -1, -1)),
        TensorSpec(ATTN_WEIGHTS_MEAN, weights, (-1, -1, -1)),
        TensorSpec(ATTN_TOP_K_VALUES, weights, (-1, -1, -1, -1)),
        TensorSpec(ATTN_TOP_K_INDICES, "INT64", (-1, -1, -1, -1)),
        TensorSpec(ATTN_ENTROPY, "FP32", (-1, -1, -1)),
        TensorSpec(ATTN_SINK, weights, (-1, -1, -1)),
        TensorSpec(ATTN_MAX, weights, (-1, -1, -1)),
        TensorSpec(ATTN_MAX_INDEX, "INT64", (-1, -1, -1)),
    ]


def graph_outputs_for(requested: tuple[str, ...], summaries_graph: bool = False) -> tuple[str, ...]:
    """The graph outputs a run must fetch to answer ``requested`` (the mean is taken from the weights): where the
    version has a summaries graph and the run asks for summaries and no weights, that graph's summaries asked, and
    the entropy always (a NaN weight makes it NaN: the run's overflow check reads it)."""
    asked = set(requested)
    if summaries_graph and asked & set(SUMMARY_OUTPUT_NAMES) and asked <= {OUTPUT, *SUMMARY_OUTPUT_NAMES}:
        return tuple(name for name in (OUTPUT, *SUMMARY_OUTPUT_NAMES) if name in asked or name == ATTN_ENTROPY)
    needed = {*asked, ATTN_WEIGHTS} if asked & set(WEIGHTS_OUTPUT_NAMES) else asked
    return tuple(name for name in GRAPH_OUTPUT_NAMES if name in needed)


@dataclass(frozen=True)
class ModelSignature:
    """What a served version is, as every part of the server reads it: its name and version, its size, the
    precision it was exported in, and what its folder allows."""

    name: str
    version: str
    d_model: int
    num_heads: int
    precision: str = "fp32"  # the export's (PRECISIONS): the datatype of the weights returned
    max_abs_input: float | None = None  # inputs larger in magnitude are refused (the export's validated range)
    serves_sequences: bool = False  # the folder has a step graph (export/step.py)
    # queries and keys larger in magnitude are refused: past it a mask's bias might not decide (its scores could
    # overflow past it), and a masked key could take the weight
    mask_exact_input_limit: float | None = None
