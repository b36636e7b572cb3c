"""int8 projections on this CPU: speed and accuracy of the candidate graphs, side by side. A measurement for
choosing a format, not a served feature (mhaserve exports fp32 and fp16).

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_int8.py

Candidates, each built from the traced float32 graph of a seeded module:
- dynamic: ONNX Runtime's quantize_dynamic on the four projections (int8 weights, 7-bit with reduce_range,
  uint8 activations with one scale per tensor, so a request's answer depends on what it is batched with);
- per-row, four: the four projections with weights per output column (7 bits) and activations per batch row
  (one scale per request, so batching cannot change an answer);
- per-row, value path: the same for the value and output projections only; the weights stay float32.
Printed: ms per run in process (2 threads, medians of 5 alternating rounds) and fp32/candidate; the largest
output error over the largest output magnitude and the weights' largest absolute error against eager float32,
at input scale 1 and 10 (hidden states before a LayerNorm reach tens).
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, numpy_helper
from onnx import helper as make

from mhaserve.contract import signature
from mhaserve.export.onnx_export import export_onnx, nodes_computing
from mhaserve.model import MultiHeadAttention

WEIGHT_LEVELS, ACTIVATION_LEVELS, ZERO_POINT = 63, 127, 128
SHAPES = {(512, 8): ((1, 16), (1, 128), (8, 128), (1, 512)), (768, 12): ((1, 128),)}


def projection_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The graph's products with a weight matrix: the four projections (Q·Kᵀ and P·V multiply activations)."""
    weights = {t.name for t in model.graph.initializer if len(t.dims) == 2}
    return [n for n in model.graph.node if n.op_type == "MatMul" and n.input[1] in weights]


def value_path_matmuls(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The value and output projections: the ones the attention weights are not computed from."""
    weights_from = nodes_computing(model, signature.ATTN_WEIGHTS)
    return [n for n in projection_matmuls(model) if n.name not in weights_from]


def int8_projections(model: onnx.ModelProto, four: bool) -> onnx.ModelProto:
    """``model`` with the four projections (``four``), or the value and output ones, in int8 per row: weights per
    output column in 7 bits (u8 x s8 products saturate in 16 bits on CPUs without VNNI), activations per batch
    row. Written with Div, Round and Cast: with a per-row scale, QuantizeLinear feeding MatMulInteger was fused
    by ONNX Runtime 1.31's optimizer into a kernel that took the scale as per column (three times the error)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    matmuls = projection_matmuls(model) if four else value_path_matmuls(model)
    shared = [
        numpy_helper.from_array(np.array([1, 2], np.int64), "int8.row_axes"),
        numpy_helper.from_array(np.array(1e-30, np.float32), "int8.smallest_scale"),
        numpy_helper.from_array(np.array(float(ACTIVATION_LEVELS), np.float32), "int8.activation_levels"),
        numpy_helper.from_array(np.array(float(ZERO_POINT), np.float32), "int8.zero_point_float"),
        numpy_helper.from_array(np.array(ZERO_POINT, np.uint8), "int8.activation_zero_point"),
        numpy_helper.from_array(np.array(0, np.int8), "int8.weight_zero_point"),
    ]
    replaced: dict[str, list[onnx.NodeProto]] = {}
    for matmul in matmuls:
        x, weight_name = matmul.input
        weight = numpy_helper.to_array(initializers[weight_name]).astype(np.float64)  # [d_in, d_out]
        column_scale = np.maximum(np.abs(weight).max(axis=0), 1e-30) / WEIGHT_LEVELS
        quantized = np.clip(np.round(weight / column_scale), -WEIGHT_LEVELS, WEIGHT_LEVELS).astype(np.int8)
        p = f"{matmul.name}.int8"
        shared += [
            numpy_helper.from_array(quantized, f"{p}.weight"),
            numpy_helper.from_array(column_scale.astype(np.float32), f"{p}.weight_scale"),
        ]
        replaced[matmul.name] = [
            make.make_node("Abs", [x], [f"{p}.abs"]),
            make.make_node("ReduceMax", [f"{p}.abs", "int8.row_axes"], [f"{p}.row_max"], keepdims=1),
            make.make_node("Max", [f"{p}.row_max", "int8.smallest_scale"], [f"{p}.row_max_safe"]),
            make.make_node("Div", [f"{p}.row_max_safe", "int8.activation_levels"], [f"{p}.row_scale"]),
            make.make_node("Div", [x, f"{p}.row_scale"], [f"{p}.scaled"]),
            make.make_node("Round", [f"{p}.scaled"], [f"{p}.rounded"]),
            make.make_node("Add", [f"{p}.rounded", "int8.zero_point_float"], [f"{p}.shifted"]),
            make.make_node("Cast", [f"{p}.shifted"], [f"{p}.activations"], to=TensorProto.UINT8),
            make.make_node(
                "MatMulInteger",
                [f"{p}.activations", f"{p}.weight", "int8.activation_zero_point", "int8.weight_zero_point"],
                [f"{p}.sums"],
            ),
            make.make_node("Cast", [f"{p}.sums"], [f"{p}.sums_float"], to=TensorProto.FLOAT),
            make.make_node("Mul", [f"{p}.sums_float", f"{p}.weight_scale"], [f"{p}.by_column"]),
            make.make_node("Mul", [f"{p}.by_column", f"{p}.row_scale"], list(matmul.output)),
        ]
    nodes = []
    for node in graph.node:
        nodes.extend(replaced.get(node.name, [node]))
    del graph.node[:]
    graph.node.extend(nodes)
    used = {name for node in graph.node for name in node.input}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept + [t for t in shared if t.name in used])
    return model


def dynamic(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)  # its advice to pre-process first
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(model, f"{tmp}/float32.onnx")
        names = [n.name for n in projection_matmuls(model)]
        quantize_dynamic(f"{tmp}/float32.onnx", f"{tmp}/int8.onnx", nodes_to_quantize=names,
                         weight_type=QuantType.QInt8, reduce_range=True)  # fmt: skip
        return onnx.load(f"{tmp}/int8.onnx")


def errors(session, module, scale: float, d: int) -> tuple[float, float]:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 64, d)) * scale).astype(np.float32)
    mask = np.ones((1, 1, 1, 64), dtype=bool)
    with torch.no_grad():
        want_out, want_weights = (t.numpy() for t in module(*(torch.from_numpy(x),) * 3))
    out, weights = session.run(None, {"query": x, "key": x, "value": x, "mask": mask})
    return float(np.abs(out - want_out).max() / np.abs(want_out).max()), float(np.abs(weights - want_weights).max())


def main() -> None:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    header = "| model | shape | fp32 ms | candidate | ms | fp32 / candidate | output rel err (scale 1, 10) |"
    print(header + " weights abs err (scale 1, 10) |")
    print("|---|---|--:|---|--:|--:|---|---|")
    for (d, heads), shapes in SHAPES.items():
        torch.manual_seed(0)
        module = MultiHeadAttention(d, heads).eval()
        traced = export_onnx(module)
        graphs = {"fp32": traced, "dynamic": dynamic(traced), "per-row, four": int8_projections(traced, four=True),
                  "per-row, value path": int8_projections(traced, four=False)}  # fmt: skip
        sessions = {k: ort.InferenceSession(g.SerializeToString(), options, providers=["CPUExecutionProvider"])
                    for k, g in graphs.items()}  # fmt: skip
        accuracy = {k: [errors(s, module, scale, d) for scale in (1.0, 10.0)] for k, s in sessions.items()}
        rng = np.random.default_rng(0)
        for batch, length in shapes:
            x = rng.standard_normal((batch, length, d), dtype=np.float32)
            feeds = {"query": x, "key": x, "value": x, "mask": np.ones((1, 1, 1, length), dtype=bool)}
            runs = 100 if batch * length <= 128 else 20
            measured = {k: [] for k in sessions}
            for round_number in range(5):
                for k in list(sessions)[:: 1 if round_number % 2 == 0 else -1]:
                    for _ in range(2):
                        sessions[k].run(None, feeds)
                    times = []
                    for _ in range(runs):
                        started = time.perf_counter()
                        sessions[k].run(None, feeds)
                        times.append(time.perf_counter() - started)
                    measured[k].append(statistics.median(times) * 1e3)
            base = statistics.median(measured["fp32"])
            for k in list(sessions)[1:]:
                ms = statistics.median(measured[k])
                (o1, w1), (o10, w10) = accuracy[k]
                print(f"| {d}/{heads} | [{batch},{length},{d}] | {base:.2f} | {k} | {ms:.2f} | {base / ms:.2f} | "
                      f"{o1:.1e}, {o10:.1e} | {w1:.1e}, {w10:.1e} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
