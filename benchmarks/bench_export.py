"""Eager PyTorch vs ONNX Runtime on the exported graph, side by side in one run, and both vs the FLOP floor.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_export.py [--threads 2] [--reps 200]

For each (B, L, d, h): self-attention, median time per call of eager (torch, eval, no_grad) and of
ORT (CPU provider), measured in alternating rounds so both see the same machine noise. The floor is
the FLOP count (8 B L d^2 + 4 B L^2 d) over this machine's measured large-GEMM rate at the same threads.
"Matmuls" is a graph of the model's six matrix products and nothing else (the four projections, Q K^T
and P V, at the same shapes, in the same ORT and the same rounds): the practical floor for any graph of
this model on ONNX Runtime's CPU kernels, since small GEMMs do not reach the large-GEMM rate.
Not a test: it prints numbers; BENCHMARKS.md records them with this command.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
import torch
from bench_server import ort_session
from onnx import TensorProto, helper, numpy_helper

from mhaserve.export.onnx_export import export_onnx
from mhaserve.model import seeded_module

SHAPES = [(1, 16, 512, 8), (1, 128, 512, 8), (8, 128, 512, 8), (1, 512, 512, 8), (1, 128, 768, 12), (1, 128, 4096, 32)]


def gemm_rate(threads: int, n: int = 2048, reps: int = 10) -> float:
    """FLOP/s of a large float32 matmul (torch's BLAS, the same one eager uses)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return 2 * n**3 / min(times)


def flops(b, seq_len, d):
    return 8 * b * seq_len * d * d + 4 * b * seq_len * seq_len * d


def time_calls(fn, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def matmuls_only(b, seq_len, d, h, rng):
    """The model's six matrix products as one graph, and feeds for it.

    The four projections ([B, L, d] x [d, d]) are chained, and Q K^T and P V take their own inputs, so the
    graph returns what the model returns ([B, L, d] and [B, h, L, L]) plus [B, h, L, d_k]: the same products,
    close to the same bytes handed back to Python.
    """
    d_k = d // h
    # Scaled so that chained products stay near unit size (no overflow, no denormals).
    weights = [
        numpy_helper.from_array(rng.standard_normal((d, d), dtype=np.float32) * d**-0.5, f"w{i}") for i in range(4)
    ]
    shapes = {"x": (b, seq_len, d), "q": (b, h, seq_len, d_k), "k_t": (b, h, d_k, seq_len),
              "p": (b, h, seq_len, seq_len), "v": (b, h, seq_len, d_k)}  # fmt: skip
    products = [("x", "w0", "x1"), ("x1", "w1", "x2"), ("x2", "w2", "x3"), ("x3", "w3", "projected"),
                ("q", "k_t", "scores"), ("p", "v", "context")]  # fmt: skip
    graph = helper.make_graph(
        [helper.make_node("MatMul", [a, b_], [out]) for a, b_, out in products],
        "matmuls",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, shape) for name, shape in shapes.items()],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("projected", "scores", "context")],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    feeds = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in shapes.items()}
    return model, feeds


def measure(shape, threads, reps, rounds=10):
    b, seq_len, d, h = shape
    module = seeded_module(d, h)
    session = ort_session(export_onnx(module).SerializeToString(), threads)
    rng = np.random.default_rng(0)
    matmuls_model, matmuls_feeds = matmuls_only(b, seq_len, d, h, rng)
    matmuls_session = ort_session(matmuls_model.SerializeToString(), threads)
    x = rng.standard_normal((b, seq_len, d), dtype=np.float32)
    mask = np.ones((1, 1, 1, seq_len), dtype=bool)
    feeds = {"query": x, "key": x, "value": x, "mask": mask}
    tx = torch.from_numpy(x)

    def eager():
        with torch.no_grad():
            module(tx, tx, tx)

    def onnx():
        session.run(None, feeds)

    def matmuls():
        matmuls_session.run(None, matmuls_feeds)

    per_round = max(1, reps // rounds)
    variants = (eager, onnx, matmuls)
    times = {fn: [] for fn in variants}
    for fn in variants:  # warm-up
        time_calls(fn, 5)
    for _ in range(rounds):
        for fn in variants:
            times[fn] += time_calls(fn, per_round)
    return [statistics.median(times[fn]) for fn in variants]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rate = gemm_rate(args.threads)
    print(f"torch {torch.__version__}, onnxruntime {ort.__version__}, threads {args.threads}")
    print(f"large-GEMM rate (2048^3 float32): {rate / 1e9:.1f} GFLOP/s")
    # How far below eager a graph can go: ORT cannot beat the floor, nor in practice its own matmuls.
    header = ("B", "L", "d", "h", "eager ms", "ORT ms", "ORT/eager", "floor ms", "ORT/floor", "eager/floor",
              "matmuls ms", "matmuls/floor", "matmuls/eager")  # fmt: skip
    print("{:>2} {:>4} {:>5} {:>3} | {:>9} {:>9} {:>9} | {:>9} {:>9} {:>11} | {:>10} {:>13} {:>13}".format(*header))
    for shape in SHAPES:
        reps = args.reps if shape[2] < 4096 else max(20, args.reps // 10)
        eager_s, ort_s, matmuls_s = measure(shape, args.threads, reps)
        floor_s = flops(shape[0], shape[1], shape[2]) / rate
        b, seq_len, d, h = shape
        print(
            f"{b:>2} {seq_len:>4} {d:>5} {h:>3} | {eager_s * 1e3:9.3f} {ort_s * 1e3:9.3f} {ort_s / eager_s:9.2f} | "
            f"{floor_s * 1e3:9.3f} {ort_s / floor_s:9.2f} {eager_s / floor_s:11.2f} | "
            f"{matmuls_s * 1e3:10.3f} {matmuls_s / floor_s:13.2f} {matmuls_s / eager_s:13.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
