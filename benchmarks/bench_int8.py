"""int8 projections on this CPU: the format, the speed against float32, and the accuracy the policy is set from.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_int8.py formats speed accuracy

formats: the candidate int8 graphs, built from the traced float32 graph of the default module (512/8, seed 0) and
of 768/12, side by side: ONNX Runtime's quantize_dynamic (one activation scale per tensor, the fused
DynamicQuantizeMatMul), the served form (export/int8.py: inputs per token as uint8, MatMulIntegerToFloat), inputs
per token as int8 into MatMulInteger (the pairing ONNX Runtime's CUDA provider has), and MatMulNBits (8-bit weights
in blocks of 32, inputs quantized per block by the kernel, accuracy level 4). Printed: float32's time over each
one's (2 threads, medians of 5 alternating rounds), whether a request's answer is the same alone and beside a
request ten times larger, and the errors at input scale 1 against the module in float64 (output: over its largest
magnitude; weights: absolute).

speed: the served int8 graph against float32 at [1,16,512], [1,128,512], [8,128,512], [1,512,512],
[1,128,768] and [1,128,4096], each in the server's own AttentionGraphs (2 threads, medians of 5 alternating
rounds).

accuracy: the validation matrix (the 68 cases every export runs) and the input scales, on int8 exports of
512/8, 768/12 and 4096/32, with seeded (random) weights and with weights trained on a lookup task (attention
that learned to pick keys: larger, structured query and key projections); the worst errors against float32
eager, and the largest input magnitude each holds.
"""

from __future__ import annotations

import logging
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, numpy_helper
from onnx import helper as make

from mhaserve.export.int8 import int8_projections, projection_matmuls, quantize_columns, replace_nodes
from mhaserve.export.onnx_export import export_onnx
from mhaserve.model import MultiHeadAttention, seeded_module

THREADS = 2


def options() -> ort.SessionOptions:
    o = ort.SessionOptions()
    o.intra_op_num_threads = THREADS
    o.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return o


def signed_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Inputs per token as int8 (no zero point) into MatMulInteger, then Cast and the two scales: the form ONNX
    Runtime's CUDA provider has a kernel for (int8 x int8)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    initializers = {t.name: t for t in model.graph.initializer}
    added = [
        numpy_helper.from_array(np.array([-1], np.int64), "s8.last_axis"),
        numpy_helper.from_array(np.array(1e-30, np.float32), "s8.smallest"),
        numpy_helper.from_array(np.array(127.0, np.float32), "s8.levels"),
    ]
    replaced = {}
    for matmul in projection_matmuls(model):
        x, weight = matmul.input
        quantized, column_scale = quantize_columns(numpy_helper.to_array(initializers[weight]))
        p = f"{matmul.name}.s8"
        added += [numpy_helper.from_array(quantized, f"{p}.w"), numpy_helper.from_array(column_scale, f"{p}.cs")]
        replaced[matmul.name] = [
            make.make_node("Abs", [x], [f"{p}.abs"]),
            make.make_node("ReduceMax", [f"{p}.abs", "s8.last_axis"], [f"{p}.max"], keepdims=1),
            make.make_node("Max", [f"{p}.max", "s8.smallest"], [f"{p}.range"]),
            make.make_node("Div", [f"{p}.range", "s8.levels"], [f"{p}.rs"]),
            make.make_node("Div", [x, f"{p}.rs"], [f"{p}.scaled"]),
            make.make_node("Round", [f"{p}.scaled"], [f"{p}.rounded"]),
            make.make_node("Cast", [f"{p}.rounded"], [f"{p}.a"], to=TensorProto.INT8),
            make.make_node("MatMulInteger", [f"{p}.a", f"{p}.w"], [f"{p}.sums"]),
            make.make_node("Cast", [f"{p}.sums"], [f"{p}.f"], to=TensorProto.FLOAT),
            make.make_node("Mul", [f"{p}.f", f"{p}.cs"], [f"{p}.bc"]),
            make.make_node("Mul", [f"{p}.bc", f"{p}.rs"], list(matmul.output)),
        ]
    replace_nodes(model, replaced, added)
    return model


def dynamic(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.getLogger().setLevel(logging.ERROR)  # its advice to pre-process first
    with tempfile.TemporaryDirectory() as tmp:
        onnx.save(model, f"{tmp}/float32.onnx")
        names = [n.name for n in projection_matmuls(model)]
        quantize_dynamic(f"{tmp}/float32.onnx", f"{tmp}/int8.onnx", nodes_to_quantize=names,
                         weight_type=QuantType.QInt8)  # fmt: skip
        return onnx.load(f"{tmp}/int8.onnx")


def nbits(model: onnx.ModelProto) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger().setLevel(logging.ERROR)
    model = onnx.ModelProto.FromString(model.SerializeToString())  # the quantizer rewrites its argument
    names = [n.name for n in projection_matmuls(model)]
    quantizer = MatMulNBitsQuantizer(model, bits=8, block_size=32, is_symmetric=True, accuracy_level=4,
                                     nodes_to_include=names)  # fmt: skip
    quantizer.process()
    return quantizer.model.model


def trained_module(d: int, heads: int, steps: int = 150) -> MultiHeadAttention:
    """Trained to look up: each position's answer is the value of the other position whose input is most like it.
    The query and key projections grow and align, as a trained layer's do (sharp, structured attention)."""
    torch.manual_seed(0)
    module = MultiHeadAttention(d, heads)
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-4)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 32, d, generator=generator)
        similar = x @ x.transpose(1, 2)
        similar.diagonal(dim1=1, dim2=2).fill_(-torch.inf)
        target = x[torch.arange(8)[:, None], similar.argmax(-1)]
        loss = (module(x, x, x)[0] - target).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return module.eval()


def errors_at(session: ort.InferenceSession, module: MultiHeadAttention, scale: float) -> tuple[float, float]:
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, 64, module.d_model)) * scale).astype(np.float32)
    exact = seeded_module(module.d_model, module.num_heads, 0).double()
    exact.load_state_dict({k: v.double() for k, v in module.state_dict().items()})
    with torch.no_grad():
        want_out, want_weights = (t.numpy() for t in exact(*(torch.from_numpy(x).double(),) * 3))
    out, weights = session.run(None, {"query": x, "key": x, "value": x, "mask": np.ones((1, 1, 1, 64), bool)})
    return float(np.abs(out - want_out).max() / np.abs(want_out).max()), float(np.abs(weights - want_weights).max())


def same_in_any_batch(session: ort.InferenceSession, d: int) -> bool:
    rng = np.random.default_rng(3)
    alone = rng.standard_normal((1, 16, d)).astype(np.float32)
    beside = np.concatenate([alone, (rng.standard_normal((1, 16, d)) * 10).astype(np.float32)])
    mask = np.ones((1, 1, 1, 16), bool)
    one = session.run(None, {"query": alone, "key": alone, "value": alone, "mask": mask})
    two = session.run(None, {"query": beside, "key": beside, "value": beside, "mask": mask})
    return all(np.abs(a[0] - b[0]).max() <= 1e-6 for a, b in zip(one, two, strict=True))


def alternating(runs: dict, rounds: int = 5, calls: int = 40) -> dict[str, float]:
    """Median ms per call of each zero-argument callable, in rounds alternating their order."""
    measured = {k: [] for k in runs}
    for r in range(rounds):
        for k in list(runs)[:: 1 if r % 2 == 0 else -1]:
            for _ in range(3):
                runs[k]()
            times = []
            for _ in range(calls):
                started = time.perf_counter()
                runs[k]()
                times.append(time.perf_counter() - started)
            measured[k].append(statistics.median(times) * 1e3)
    return {k: statistics.median(v) for k, v in measured.items()}


def formats() -> None:
    print("| model | candidate | same in any batch | output rel err | weights abs err | "
          "fp32 / candidate time at [1,128,d] | at [8,128,d] |")  # fmt: skip
    print("|---|---|---|--:|--:|--:|--:|")
    for d, heads in ((512, 8), (768, 12)):
        module = seeded_module(d, heads, 0).eval()
        traced = export_onnx(module)
        graphs = {
            "fp32": traced,
            "quantize_dynamic (per tensor)": dynamic(traced),
            "per token, uint8 x int8, fused (served)": int8_projections(traced),
            "per token, int8 x int8, MatMulInteger": signed_inputs(traced),
            "MatMulNBits 8-bit, block 32": nbits(traced),
        }
        sessions = {k: ort.InferenceSession(g.SerializeToString(), options(), providers=["CPUExecutionProvider"])
                    for k, g in graphs.items()}  # fmt: skip
        ratios = []
        for batch in (1, 8):
            x = np.random.default_rng(0).standard_normal((batch, 128, d), dtype=np.float32)
            feeds = {"query": x, "key": x, "value": x, "mask": np.ones((1, 1, 1, 128), bool)}
            runs = {k: (lambda s=s, f=feeds: s.run(None, f)) for k, s in sessions.items()}
            ms = alternating(runs, calls=160 // batch)
            ratios.append({k: ms["fp32"] / v for k, v in ms.items()})
        for k, s in sessions.items():
            if k == "fp32":
                continue
            out, weights = errors_at(s, module, 1.0)
            print(f"| {d}/{heads} | {k} | {'yes' if same_in_any_batch(s, d) else 'no'} | {out:.1e} | {weights:.1e} | "
                  f"{ratios[0][k]:.2f} | {ratios[1][k]:.2f} |", flush=True)  # fmt: skip


def speed() -> None:
    from mhaserve.export.writer import export_model_dir
    from mhaserve.server.graphs import AttentionGraphs

    print("| shape | fp32 ms | int8 ms | fp32 / int8 |")
    print("|---|--:|--:|--:|")
    shapes = {(512, 8): ((1, 16), (1, 128), (8, 128), (1, 512)), (768, 12): ((1, 128),), (4096, 32): ((1, 128),)}
    with tempfile.TemporaryDirectory() as tmp:
        for (d, heads), sizes in shapes.items():
            module = seeded_module(d, heads, 0).eval()
            sessions = {}
            for precision in ("fp32", "int8"):
                folder = f"{tmp}/{d}-{precision}"
                export_model_dir(module, folder, precision=precision, validation_seed=0, report=lambda _: None)
                sessions[precision] = AttentionGraphs.open(folder, device="cpu", intra_op_threads=THREADS)
            for batch, length in sizes:
                x = np.random.default_rng(0).standard_normal((batch, length, d), dtype=np.float32)
                mask = np.ones((1, 1, 1, length), bool)
                calls = max(10, min(200, int(4e9 / (batch * length * d * d * 8))))
                runs = {k: (lambda s=s, x=x, m=mask: s.run(("output", "attn_weights"), x, x, x, m))
                        for k, s in sessions.items()}  # fmt: skip
                ms = alternating(runs, calls=calls)
                ratio = ms["fp32"] / ms["int8"]
                print(f"| [{batch},{length},{d}] | {ms['fp32']:.3f} | {ms['int8']:.3f} | {ratio:.2f} |", flush=True)


def accuracy() -> None:
    from mhaserve.export.writer import export_model_dir

    print("| model | weights | cases passed | worst output rel err | worst weights abs err | "
          "holds for inputs up to | float32 holds up to |")  # fmt: skip
    print("|---|---|--:|--:|--:|--:|--:|")
    with tempfile.TemporaryDirectory() as tmp:
        for d, heads in ((512, 8), (768, 12), (4096, 32)):
            for kind in ("random", "trained"):
                steps = 150 if d < 4096 else 40
                module = seeded_module(d, heads, 0) if kind == "random" else trained_module(d, heads, steps)
                row = {}
                for precision in ("int8", "fp32"):
                    row[precision] = export_model_dir(module, f"{tmp}/{d}-{kind}-{precision}", precision=precision,
                                                      validation_seed=0, report=lambda _: None)  # fmt: skip
                validation = row["int8"]["validation"]
                cases = validation["cases"]
                passed = sum(c["status"] in ("pass", "undefined") for c in cases)
                worst_out = max(c["output_max_rel"] for c in cases)
                worst_weights = max(c["attn_max_abs"] for c in cases)

                def held(manifest):
                    limit = manifest["validation"]["input_scales"]["max_abs_input"]
                    return "none" if limit is None else f"{limit:.3g}"

                print(f"| {d}/{heads} | {kind} | {passed}/{len(cases)} | {worst_out:.2e} | {worst_weights:.2e} | "
                      f"{held(row['int8'])} | {held(row['fp32'])} |", flush=True)  # fmt: skip
                if validation["worst_failure"]:
                    print(f"|   | {validation['worst_failure']} |||||", flush=True)


if __name__ == "__main__":
    logging.getLogger().setLevel(logging.ERROR)
    for part in sys.argv[1:] or ("formats", "speed", "accuracy"):
        {"formats": formats, "speed": speed, "accuracy": accuracy}[part]()
