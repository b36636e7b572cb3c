"""The step graph as exported (the module's own ONNX operators) against the same graph with ONNX's ``Attention``
operator (opset 23: past and present keys and values, the softmax weights as ``qk_matmul_output``), in process.

    flock /tmp/bench.lock .venv/bin/python benchmarks/bench_step_graph.py [--rounds 5] [--runs 200]

Both graphs take the same inputs (the step's rows, the past keys and values, each batch row's past length) and
the same additive mask (causal among the new rows, padding on the left masked); their answers are checked equal
first. Then ms per run (medians over rounds, alternating which graph goes first) for one-row steps of one
sequence at several past lengths and of 16 sequences at a short past, on the default model's sizes (512/8) at
ONNX Runtime's two intra-op threads. Not a test: BENCHMARKS.md records the figures.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper as make

from mhaserve.contract import signature
from mhaserve.contract.steps import PAST_LENGTHS
from mhaserve.export.step import PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE, step_graph
from mhaserve.model import MultiHeadAttention

ATTENTION_OPSET = 23
# The nodes of the exported graph that the Attention operator replaces: from the caches' concatenation to the
# weighted values, the mask's nodes kept apart (they feed the operator's attn_mask).
REPLACED_OUTPUTS = {PRESENT_KEY, PRESENT_VALUE, "k_t", "scores_raw", "scores", "biased", signature.ATTN_WEIGHTS,
                    "context_heads"}  # fmt: skip


def attention_op_graph(module: MultiHeadAttention) -> onnx.ModelProto:
    model = step_graph(module)
    graph = model.graph
    kept = [node for node in graph.node if not set(node.output) & REPLACED_OUTPUTS]
    at = next(i for i, node in enumerate(kept) if node.output[0] == "context_split")
    attention = make.make_node(
        "Attention",
        ["q", "k_new", "v_new", "bias", PAST_KEY, PAST_VALUE],
        ["context_heads", PRESENT_KEY, PRESENT_VALUE, signature.ATTN_WEIGHTS],
        scale=1.0 / module.d_k**0.5,
        qk_matmul_output_mode=3,  # the weights after the softmax
    )
    del graph.node[:]
    graph.node.extend(kept[:at] + [attention] + kept[at:])
    del model.opset_import[:]
    model.opset_import.extend([make.make_opsetid("", ATTENTION_OPSET)])
    onnx.checker.check_model(model)
    return model


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    options.log_severity_level = 3  # ORT warns that its inferred weights shape (last dim 0) differs from the run's
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def feeds(batch: int, past: int, new: int, heads: int, d: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    lengths = np.full(batch, past, np.int64)
    lengths[1::2] = past // 2  # every other row's past is half as long: padded on the left
    return {
        signature.QUERY: rng.standard_normal((batch, new, d), dtype=np.float32),
        PAST_KEY: rng.standard_normal((batch, heads, past, d // heads), dtype=np.float32),
        PAST_VALUE: rng.standard_normal((batch, heads, past, d // heads), dtype=np.float32),
        PAST_LENGTHS: lengths,
    }


def ms_per_run(sess: ort.InferenceSession, inputs: dict, runs: int) -> float:
    started = time.perf_counter()
    for _ in range(runs):
        sess.run(None, inputs)
    return (time.perf_counter() - started) / runs * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    module = MultiHeadAttention(512, 8).eval()
    graphs = {"own ops": session(step_graph(module), args.threads),
              "Attention op": session(attention_op_graph(module), args.threads)}  # fmt: skip
    names = [o.name for o in graphs["own ops"].get_outputs()]
    for batch, past, new in ((1, 0, 3), (1, 37, 1), (4, 40, 2), (2, 128, 8)):
        inputs = feeds(batch, past, new, 8, 512, seed=past + new)
        own, op = (dict(zip(names, g.run(names, inputs), strict=True)) for g in graphs.values())
        worst = {name: float(np.abs(own[name] - op[name]).max()) for name in names}
        print(f"batch {batch}, past {past}, new {new}: largest difference {worst}")
        assert all(value < 1e-5 for value in worst.values()), worst
    cases = [(1, 16), (1, 128), (1, 512), (1, 2048), (16, 32)]
    times: dict[tuple, dict[str, list[float]]] = {}
    for round_number in range(args.rounds):
        order = list(graphs.items()) if round_number % 2 == 0 else list(graphs.items())[::-1]
        for batch, past in cases:
            inputs = feeds(batch, past, 1, 8, 512, seed=round_number)
            for name, sess in order:
                sess.run(None, inputs)  # warm
                times.setdefault((batch, past), {}).setdefault(name, []).append(ms_per_run(sess, inputs, args.runs))
    print(f"\nms per one-row step (median of {args.rounds} rounds of {args.runs} runs), Attention op / own ops:")
    for (batch, past), by_graph in times.items():
        own, op = statistics.median(by_graph["own ops"]), statistics.median(by_graph["Attention op"])
        print(f"batch {batch:>2}, past {past:>4}: own ops {own:.4f}, Attention op {op:.4f}, ratio {op / own:.2f}")


if __name__ == "__main__":
    main()
