"""int8 projections: the four ``nn.Linear`` products of the exported float32 graph in 8-bit integers.

Each projection's input is rounded to 8 bits per token (one scale per row of ``[B, L, d]``, from that row's largest
magnitude; stored as uint8 with zero point 128), its weight matrix per output column (int8, symmetric, 127 levels
each side). ONNX Runtime's ``MatMulIntegerToFloat`` multiplies them exactly in int32 and scales the sums by the
column scales; one Mul applies the row scales before the bias. The scores, the masked softmax and the weighted sum
of values stay float32, as do the graph's inputs and outputs: clients send and read what they do for float32.

Why this form (measured on a CPU with VNNI, BENCHMARKS.md, "Precision"):
- per token, not per tensor: ONNX Runtime's ``quantize_dynamic`` takes one scale for the whole input, so a
  request's answer would change with the requests batched beside it and with the padding of a batch across
  lengths; a row's own scale makes every answer the same in any batch (the integer sums are exact);
- uint8 inputs against int8 weights are the pairing the CPU's 8-bit dot-product instructions (VNNI) take: int8
  inputs ran 4-5 times slower than float32 on ONNX Runtime's CPU provider;
- the fused product with its column scales, and a multiply by each row's reciprocal range, not a divide: the
  elementwise passes around the products are what eat int8's gain at these sizes.
ONNX Runtime's CUDA provider has no kernel for uint8 x int8 products (it has int8 x int8 ``MatMulInteger`` only),
so int8 folders are served on the CPU provider (server/session.py says so at load).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx import helper as make

LEVELS = 127  # symmetric: -127..127 each side
ZERO_POINT = 128  # the inputs' uint8 zero point
_SMALLEST = 1e-30  # a row of zeros gets this largest magnitude, and rounds to zeros


def projection_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The graph's products with a weight matrix: the four projections (Q·Kᵀ and P·V multiply activations)."""
    weights = {t.name for t in model.graph.initializer if len(t.dims) == 2}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


def quantize_columns(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``weight`` [d_in, d_out] as int8 with one float32 scale per output column: ``weight ~ q * scale``."""
    weight = weight.astype(np.float64)
    scale = np.maximum(np.abs(weight).max(axis=0), _SMALLEST) / LEVELS
    quantized = np.clip(np.round(weight / scale), -LEVELS, LEVELS).astype(np.int8)
    return quantized, scale.astype(np.float32)


def int8_projections(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (the float32 export) with its four projections computing in int8 as the module docstring says."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    shared = [
        numpy_helper.from_array(np.array([-1], np.int64), "int8.last_axis"),
        numpy_helper.from_array(np.array(_SMALLEST, np.float32), "int8.smallest"),
        numpy_helper.from_array(np.array(float(LEVELS), np.float32), "int8.levels"),
        # + 128 moves -127..127 to 1..255; + 0.5 more makes the Cast's truncation round to nearest (all positive)
        numpy_helper.from_array(np.array(ZERO_POINT + 0.5, np.float32), "int8.zero_point_and_half"),
        numpy_helper.from_array(np.array(ZERO_POINT, np.uint8), "int8.zero_point"),
        numpy_helper.from_array(np.array(1.0, np.float32), "int8.unit_scale"),
    ]
    replaced: dict[str, list[onnx.NodeProto]] = {}
    for matmul in projection_matmuls(model):
        x, weight_name = matmul.input
        quantized, column_scale = quantize_columns(numpy_helper.to_array(initializers[weight_name]))
        p = f"{matmul.name}.int8"
        shared += [
            numpy_helper.from_array(quantized, f"{p}.weight"),
            numpy_helper.from_array(column_scale, f"{p}.weight_scale"),
        ]
        node = make.make_node
        replaced[matmul.name] = [
            node("Abs", [x], [f"{p}.abs"], name=f"{p}.abs"),
            node("ReduceMax", [f"{p}.abs", "int8.last_axis"], [f"{p}.row_max"], keepdims=1, name=f"{p}.row_max"),
            node("Max", [f"{p}.row_max", "int8.smallest"], [f"{p}.row_range"], name=f"{p}.row_range"),
            node("Div", [f"{p}.row_range", "int8.levels"], [f"{p}.row_scale"], name=f"{p}.row_scale"),
            node("Div", ["int8.levels", f"{p}.row_range"], [f"{p}.row_inverse"], name=f"{p}.row_inverse"),
            node("Mul", [x, f"{p}.row_inverse"], [f"{p}.scaled"], name=f"{p}.scaled"),
            node("Add", [f"{p}.scaled", "int8.zero_point_and_half"], [f"{p}.shifted"], name=f"{p}.shifted"),
            node("Cast", [f"{p}.shifted"], [f"{p}.input"], to=TensorProto.UINT8, name=f"{p}.input"),
            node(
                "MatMulIntegerToFloat",
                [f"{p}.input", f"{p}.weight", "int8.unit_scale", f"{p}.weight_scale", "int8.zero_point"],
                [f"{p}.by_column"],
                name=f"{p}.matmul",
                domain="com.microsoft",
            ),
            node("Mul", [f"{p}.by_column", f"{p}.row_scale"], list(matmul.output), name=f"{p}.by_row"),
        ]
    replace_nodes(model, replaced, shared)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(make.make_opsetid("com.microsoft", 1))
    return model


def replace_nodes(
    model: onnx.ModelProto, replaced: dict[str, list[onnx.NodeProto]], added: list[onnx.TensorProto]
) -> None:
    """In place: each node named in ``replaced`` becomes its list of nodes, in order; of the initializers, the
    graph's own and ``added``, only those some node reads are kept (the float32 weight matrices go)."""
    graph = model.graph
    nodes = [n for node in graph.node for n in replaced.get(node.name, [node])]
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    kept = [t for t in [*graph.initializer, *added] if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
