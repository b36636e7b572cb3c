"""Export the MHA module to an ONNX graph with dynamic batch, sequence and mask axes.

Through torch's supported exporter, torch.export (``dynamo=True``). Left to itself it cannot express a
mask dim that is "1 or B": broadcasting the mask against the scores in torch code makes a guard that
ties the mask's batch to the query's (or fixes it to 1), and likewise its query length. So the few
steps that touch the mask, and the reshapes that split and merge heads, are custom ops
(``mhaserve::*`` in model/mha.py) that torch.export treats as opaque and that ``translations`` below
write as plain ONNX: the graph broadcasts [B|1, 1, Lq|1, Lk] masks at run time, and reshapes to
constant shapes whose 0s keep B and L, so it computes no shapes at run time (28 nodes, as the
TorchScript graph had).

The example inputs still matter (tests/export/test_export.py guards each trap):
- no dynamic dim is 1 in the example, or it can be baked into the graph as a constant;
- query and key have different lengths and are different tensors, or Lk is tied to Lq and the
  graph never reads ``key``;
- the mask's batch and query-length dims get names of their own, so a graph never takes the
  batch size from the mask and accepts both [B, 1, 1, Lk] and [B, 1, Lq, Lk].
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from onnxscript import opset18 as op
from torch import nn
from torch.export import Dim

from mhaserve.contract import signature
from mhaserve.model import MultiHeadAttention

# The opset torch.export's ONNX translation is written for; ReduceMax takes its axes as an input from 18. The lowest
# an export may ask for: below it the exporter gave an opset-18 graph all the same.
DEFAULT_OPSET = 18
INPUT_NAMES = signature.INPUT_NAMES
OUTPUT_NAMES = signature.GRAPH_OUTPUT_NAMES
_BATCH, _Q_LEN, _KV_LEN = Dim("batch"), Dim("q_len"), Dim("kv_len")
DYNAMIC_SHAPES = {
    "query": {0: _BATCH, 1: _Q_LEN},
    "key": {0: _BATCH, 1: _KV_LEN},
    "value": {0: _BATCH, 1: _KV_LEN},
    "mask": {0: Dim("mask_batch"), 2: Dim("mask_q_len"), 3: _KV_LEN},
}
# Distinct and never 1: see the module docstring.
EXAMPLE_BATCH, EXAMPLE_Q_LEN, EXAMPLE_KV_LEN = 2, 5, 7
# Protobuf cannot hold a model over 2 GiB; beyond this, weights go to an external data file.
SINGLE_FILE_LIMIT_BYTES = 1_800_000_000

PRECISIONS = signature.PRECISIONS


def translations() -> dict:
    """The custom ops as ONNX."""
    lowest = float(torch.finfo(torch.float32).min)

    def masked_softmax(scores, allowed):
        """model.mha.masked_softmax in ONNX, broadcasting the mask at run time."""
        allowed = op.CastLike(allowed, scores)
        lowest_half = op.CastLike(op.Constant(value_float=lowest / 2), scores)
        bias = op.Mul(op.Sub(op.CastLike(op.Constant(value_float=1.0), scores), allowed), lowest_half)
        attends = op.ReduceMax(allowed, op.Constant(value_ints=[-1]), keepdims=1)
        weights = op.Mul(op.Softmax(op.Add(scores, bias), axis=-1), attends)
        return weights, op.ReduceMax(attends, op.Constant(value_ints=[1]), keepdims=0)

    def scale_rows(x, factor):
        return op.Mul(x, factor)

    def reshape_keeping_batch_and_length(x, tail):
        # The last dim as -1 (it follows from the others); 0 copies the input's dim, so B and L stay dynamic.
        return op.Reshape(x, op.Constant(value_ints=[0, 0, *tail[:-1], -1]))

    return {
        torch.ops.mhaserve.masked_softmax.default: masked_softmax,
        torch.ops.mhaserve.scale_rows.default: scale_rows,
        torch.ops.mhaserve.reshape_keeping_batch_and_length.default: reshape_keeping_batch_and_length,
    }


def nodes_computing(model: onnx.ModelProto, tensor: str) -> set[str]:
    """The names of the nodes ``tensor`` is computed from (its producer and everything upstream of it)."""
    producers = {output: node for node in model.graph.node for output in node.output}
    found: set[str] = set()
    pending = [tensor]
    while pending:
        node = producers.get(pending.pop())
        if node is not None and node.name not in found:
            found.add(node.name)
            pending.extend(node.input)
    return found


FLOAT, FLOAT16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
FLOAT16_MAX = 65504.0


def _tensor_to_float16(tensor: onnx.TensorProto) -> onnx.TensorProto:
    # Clipped to float16's range, as ONNX Runtime's converter does (the masking bias is float32's lowest / 2).
    values = np.clip(onnx.numpy_helper.to_array(tensor), -FLOAT16_MAX, FLOAT16_MAX).astype(np.float16)
    return onnx.numpy_helper.from_array(values, tensor.name)


def to_float16(
    model: onnx.ModelProto, float16_nodes: set[str] | None = None, float16_outputs: tuple[str, ...] = ()
) -> onnx.ModelProto:
    """The graph with the nodes named in ``float16_nodes`` (all, if None) computing in float16, the rest in
    float32, and one Cast wherever a value crosses between the two. Graph inputs stay float32, and so do
    the graph outputs other than ``float16_outputs``, so every client sends and reads what it does for a
    float32 model. Float constants and weights used only in float16 are stored in float16.
    """
    from onnxruntime.transformers.onnx_model import OnnxModel

    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    graph = model.graph
    typed = [*graph.input, *graph.value_info, *graph.output]
    floats = {v.name for v in typed if v.type.tensor_type.elem_type == FLOAT}
    floats.update(t.name for t in graph.initializer if t.data_type == FLOAT)
    half = {n.name for n in graph.node} if float16_nodes is None else set(float16_nodes)
    producers = {output: node for node in graph.node for output in node.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in dict.fromkeys(node.input):
            consumers.setdefault(name, []).append(node)
    initializers = {t.name: t for t in graph.initializer}
    wanted_out = {o.name: FLOAT16 if o.name in float16_outputs else FLOAT for o in graph.output}
    casts = []
    for name in sorted(floats):
        users = consumers.get(name, [])
        if name in initializers and users and all(n.name in half for n in users):
            initializers[name].CopyFrom(_tensor_to_float16(initializers[name]))
            continue
        made = FLOAT16 if name in producers and producers[name].name in half else FLOAT
        other = FLOAT if made == FLOAT16 else FLOAT16
        readers = [n for n in users if (FLOAT16 if n.name in half else FLOAT) == other]
        if not readers and wanted_out.get(name, made) == made:
            continue
        suffix = {FLOAT: "_float32", FLOAT16: "_float16"}
        if wanted_out.get(name) == other:  # the graph output keeps its name and gets the Cast's dtype
            own = name + suffix[made]
            producers[name].output[:] = [own if o == name else o for o in producers[name].output]
            for node in users:
                if node not in readers:
                    node.input[:] = [own if i == name else i for i in node.input]
            source, target = own, name
        else:
            source, target = name, name + suffix[other]
            for node in readers:
                node.input[:] = [target if i == name else i for i in node.input]
        casts.append(onnx.helper.make_node("Cast", [source], [target], name=f"{target}_cast", to=other))
    for node in graph.node:
        if node.name in half:
            for attribute in node.attribute:
                if node.op_type == "Cast" and attribute.name == "to" and attribute.i == FLOAT:
                    attribute.i = FLOAT16
                if node.op_type == "Constant" and attribute.t.data_type == FLOAT:
                    attribute.t.CopyFrom(_tensor_to_float16(attribute.t))
    graph.node.extend(casts)
    for output in graph.output:
        output.type.tensor_type.elem_type = wanted_out[output.name]
    del graph.value_info[:]
    converted = OnnxModel(model)
    converted.topological_sort()  # the Casts were appended; the ONNX checker wants nodes in order
    return converted.model


def float16_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """The served float16 graph: what computes the attention weights (the query and key projections, the
    scores, the masked softmax) stays in float32, and the value projection, the weighted sum of values and
    the output projection compute in float16. The scores' error is their magnitude times the rounding of
    the query and key, so in float16 it grows with the inputs' scale until the softmax goes wrong (measured
    when it was chosen); the value path's error stays relative to the values. The
    weights are returned in float16 (half the bytes), rounded once from float32."""
    weights = nodes_computing(model, signature.ATTN_WEIGHTS)
    half = {node.name for node in model.graph.node} - weights
    return to_float16(model, half, float16_outputs=(signature.ATTN_WEIGHTS,))


class _OnnxSignature(nn.Module):
    """The served signature: every input explicit, the mask as [B|1, 1, Lq|1, Lk] bool."""

    def __init__(self, mha: MultiHeadAttention):
        super().__init__()
        self.mha = mha
        self.eval()  # serving is inference: no dropout, and the exporter asks for eval mode

    def forward(self, query, key, value, mask):
        return self.mha(query, key, value, mask)


def example_inputs(d_model: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(EXAMPLE_BATCH, EXAMPLE_Q_LEN, d_model, generator=generator)
    key = torch.randn(EXAMPLE_BATCH, EXAMPLE_KV_LEN, d_model, generator=generator)
    value = torch.randn(EXAMPLE_BATCH, EXAMPLE_KV_LEN, d_model, generator=generator)
    mask = torch.ones(EXAMPLE_BATCH, 1, EXAMPLE_Q_LEN, EXAMPLE_KV_LEN, dtype=torch.bool)
    return query, key, value, mask


def export_onnx(module: MultiHeadAttention, opset: int = DEFAULT_OPSET, precision: str = "fp32") -> onnx.ModelProto:
    """Export ``module`` (in eval mode) to an ONNX model with the served signature and dynamic axes, computing
    in ``precision`` (signature.PRECISIONS)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    if opset < DEFAULT_OPSET:
        raise ValueError(f"the export is written for opset {DEFAULT_OPSET} and later, got {opset}")
    module = module.eval()
    # The exporter reports progress on stdout and warns about its own internals (axis renames, pytree
    # deprecations); none of it concerns the user, whose export is validated case by case instead.
    quiet = logging.getLogger("torch.onnx")
    level = quiet.level
    with (
        tempfile.TemporaryDirectory() as tmp,
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore")
        quiet.setLevel(logging.ERROR)
        try:
            program = torch.onnx.export(
                _OnnxSignature(module),
                example_inputs(module.d_model),
                dynamo=True,
                dynamic_shapes=DYNAMIC_SHAPES,
                input_names=list(INPUT_NAMES),
                output_names=list(OUTPUT_NAMES),
                opset_version=opset,
                custom_translation_table=translations(),
                verbose=False,
            )
            # A file, not a buffer: past 2 GiB the weights must go to external data beside it.
            program.save(Path(tmp) / "model.onnx", external_data=True)
        finally:
            quiet.setLevel(level)
        model = onnx.load(Path(tmp) / "model.onnx", load_external_data=True)
    if precision == "fp16":
        return float16_attention(model)
    if precision == "int8":
        from .int8 import int8_projections

        return int8_projections(model)
    return model


def check_onnx(model: onnx.ModelProto) -> None:
    """onnx.checker (full check) and strict shape inference; raises on any problem."""
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)


def save_onnx(model: onnx.ModelProto, path: Path) -> None:
    """One file, unless the weights are too large for a single protobuf."""
    weight_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    external = weight_bytes > SINGLE_FILE_LIMIT_BYTES
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data" if external else None,
    )
