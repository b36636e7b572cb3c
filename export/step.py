"""The step graph: one step of a growing sequence, attending over the keys and values the server keeps.

Inputs: ``query`` [B, n, d], the step's new rows (self-attention: they are the new keys and values too),
``past_key``/``past_value`` [B, h, P, d_k], the projected keys and values of the P rows before them (P may be 0),
and ``past_lengths`` [B], how many of those P rows are each batch row's own: the rest, on the left, are padding,
so that steps of sequences of different lengths run as one batch. Outputs: ``output`` [B, n, d] and
``attn_weights`` [B, h, n, P + n] for the new rows, and ``present_key``/``present_value`` [B, h, P + n, d_k], the
cache after the step (row b's own cache is its last past_lengths[b] + n rows). Row i of the step attends to every
past row of its own and causally among the new ones: a decoder's self-attention, so the steps' answers, put
together, equal the stateless answer for the whole sequence under a causal mask (validated against eager PyTorch,
alone and batched with other sequences, as every graph of an export is: validate_steps).

Built from the module's four projections with ONNX's own operators, as the output-only graph is, not traced:
torch.export cannot leave the past length free down to 0. ONNX's ``Attention`` operator (opset 23, with past and
present) gave bit-identical answers on ONNX Runtime's CPU provider and saved little of a served step, while
warning on every run about its weights' inferred shape (BENCHMARKS.md, "The step graph: the module's own
operators against ONNX's Attention op").
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto
from onnx import helper as make

from mhaserve.contract import signature
from mhaserve.contract.steps import PAST_LENGTHS, own_cache, own_weights, padded_pasts
from mhaserve.model import MultiHeadAttention

from .output_only import _constant, _linear
from .validate import TOLERANCES

OPSET = 18
PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE = "past_key", "past_value", "present_key", "present_value"


def _heads(source: str, target: str, heads: int, d_k: int) -> list:
    """[B, L, d] -> [B, h, L, d_k]."""
    return [
        make.make_node("Reshape", [source, "heads_shape"], [f"{target}.split"]),
        make.make_node("Transpose", [f"{target}.split"], [target], perm=[0, 2, 1, 3]),
    ]


def step_graph(module: MultiHeadAttention) -> onnx.ModelProto:
    module = module.eval()
    d, heads, d_k = module.d_model, module.num_heads, module.d_k
    initializers = [
        _constant("heads_shape", [0, 0, heads, d_k], np.int64),
        _constant("merged_shape", [0, 0, d], np.int64),
        _constant("scale", 1.0 / math.sqrt(d_k), np.float32),
        _constant("masked_bias", np.finfo(np.float32).min / 2, np.float32),
        _constant("no_bias", 0.0, np.float32),
        _constant("zero", 0, np.int64),
        _constant("one", 1, np.int64),
        _constant("axis_0", [0], np.int64),
        _constant("axis_1", [1], np.int64),
        _constant("per_batch_row", [-1, 1, 1, 1], np.int64),
    ]
    nodes = []
    for name, target in (("W_q", "q_flat"), ("W_k", "k_flat"), ("W_v", "v_flat")):
        more, steps = _linear(module, name, signature.QUERY, target)
        initializers += more
        nodes += steps
    nodes += _heads("q_flat", "q", heads, d_k) + _heads("k_flat", "k_new", heads, d_k)
    nodes += _heads("v_flat", "v_new", heads, d_k)
    nodes += [
        make.make_node("Concat", [PAST_KEY, "k_new"], [PRESENT_KEY], axis=2),
        make.make_node("Concat", [PAST_VALUE, "v_new"], [PRESENT_VALUE], axis=2),
        make.make_node("Transpose", [PRESENT_KEY], ["k_t"], perm=[0, 1, 3, 2]),
        make.make_node("MatMul", ["q", "k_t"], ["scores_raw"]),
        make.make_node("Mul", ["scores_raw", "scale"], ["scores"]),
        # Row i of the step may attend keys 0 .. past + i.
        make.make_node("Shape", [PAST_KEY], ["past_length_1"], start=2, end=3),
        make.make_node("Squeeze", ["past_length_1", "axis_0"], ["past_length"]),
        make.make_node("Shape", [signature.QUERY], ["new_length_1"], start=1, end=2),
        make.make_node("Squeeze", ["new_length_1", "axis_0"], ["new_length"]),
        make.make_node("Add", ["past_length", "new_length"], ["total_length"]),
        make.make_node("Range", ["zero", "total_length", "one"], ["key_positions"]),
        make.make_node("Range", ["past_length", "total_length", "one"], ["row_positions"]),
        make.make_node("Unsqueeze", ["key_positions", "axis_0"], ["keys_row"]),
        make.make_node("Unsqueeze", ["row_positions", "axis_1"], ["rows_column"]),
        make.make_node("LessOrEqual", ["keys_row", "rows_column"], ["causal"]),
        # Batch row b's own keys start at past - past_lengths[b]: those before are padding.
        make.make_node("Sub", ["past_length", PAST_LENGTHS], ["own_from_flat"]),
        make.make_node("Reshape", ["own_from_flat", "per_batch_row"], ["own_from"]),
        make.make_node("GreaterOrEqual", ["keys_row", "own_from"], ["own"]),
        make.make_node("And", ["causal", "own"], ["allowed"]),
        make.make_node("Where", ["allowed", "no_bias", "masked_bias"], ["bias"]),
        make.make_node("Add", ["scores", "bias"], ["biased"]),
        make.make_node("Softmax", ["biased"], [signature.ATTN_WEIGHTS], axis=-1),
        make.make_node("MatMul", [signature.ATTN_WEIGHTS, PRESENT_VALUE], ["context_heads"]),
        make.make_node("Transpose", ["context_heads"], ["context_split"], perm=[0, 2, 1, 3]),
        make.make_node("Reshape", ["context_split", "merged_shape"], ["context"]),
    ]
    more, steps = _linear(module, "W_o", "context", signature.OUTPUT)
    initializers += more
    nodes += steps
    inputs = [
        make.make_tensor_value_info(signature.QUERY, TensorProto.FLOAT, ["batch", "new", d]),
        make.make_tensor_value_info(PAST_KEY, TensorProto.FLOAT, ["batch", heads, "past", d_k]),
        make.make_tensor_value_info(PAST_VALUE, TensorProto.FLOAT, ["batch", heads, "past", d_k]),
        make.make_tensor_value_info(PAST_LENGTHS, TensorProto.INT64, ["batch"]),
    ]
    outputs = [
        make.make_tensor_value_info(signature.OUTPUT, TensorProto.FLOAT, ["batch", "new", d]),
        make.make_tensor_value_info(signature.ATTN_WEIGHTS, TensorProto.FLOAT, ["batch", heads, "new", "total"]),
        make.make_tensor_value_info(PRESENT_KEY, TensorProto.FLOAT, ["batch", heads, "total", d_k]),
        make.make_tensor_value_info(PRESENT_VALUE, TensorProto.FLOAT, ["batch", heads, "total", d_k]),
    ]
    graph = make.make_graph(nodes, "mha_step", inputs, outputs, initializers)
    return make.make_model(graph, opset_imports=[make.make_opsetid("", OPSET)], ir_version=10)


# (batch, sequence length) of the sequences a step graph is validated on, each cut into random steps of 1-8 rows.
STEP_CASES = ((1, 23), (2, 40), (3, 64))
MAX_STEP_ROWS = 8
# Sequences (batch, length) stepped together in one batch, their pasts of different lengths padded on the left.
BATCHED_CASE = ((1, 30), (2, 17), (1, 41))


def validate_steps(
    module: MultiHeadAttention, graph: bytes | str, seed: int | None, report: Callable[[str], None]
) -> list[dict]:
    """Each case's sequence fed to the step graph in random steps from an empty cache, every step's output rows
    and weight rows against eager PyTorch's causal answer for the whole sequence (float32's tolerance)."""
    tolerance = TOLERANCES["fp32"]
    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    heads, d_k = module.num_heads, module.d_k
    results = []
    for number, (batch, length) in enumerate(STEP_CASES, 1):
        x = rng.standard_normal((batch, length, module.d_model), dtype=np.float32)
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool))[None]
        with torch.no_grad():
            want_output, want_weights = (t.numpy() for t in module(torch.from_numpy(x), mask=causal))
        past_key = past_value = np.zeros((batch, heads, 0, d_k), np.float32)
        steps, output_error, weights_error = [], 0.0, 0.0
        position = 0
        while position < length:
            rows = min(int(rng.integers(1, MAX_STEP_ROWS + 1)), length - position)
            feed = {signature.QUERY: x[:, position : position + rows], PAST_KEY: past_key, PAST_VALUE: past_value,
                    PAST_LENGTHS: np.full(batch, position, np.int64)}  # fmt: skip
            output, weights, past_key, past_value = session.run(None, feed)
            end = position + rows
            output_error = max(output_error, float(np.abs(output - want_output[:, position:end]).max()))
            weights_error = max(weights_error, float(np.abs(weights - want_weights[:, :, position:end, :end]).max()))
            steps.append(rows)
            position = end
        output_rel = output_error / float(np.abs(want_output).max())
        held = tolerance.output.allows(output_error, output_rel) and tolerance.weights.allows(weights_error, 1.0)
        status = "pass" if held else "FAIL"
        report(
            f"step graph: [{number}/{len(STEP_CASES)}] B={batch} L={length} in {len(steps)} steps of 1-"
            f"{MAX_STEP_ROWS} rows: output abs {output_error:.1e}  attn abs {weights_error:.1e}  {status}"
        )
        results.append(
            {"batch": batch, "length": length, "steps": steps, "output_max_abs": output_error,
             "weights_max_abs": weights_error, "status": status}
        )  # fmt: skip
    results.append(_validate_batched(module, session, rng, report))
    return results


def _validate_batched(module: MultiHeadAttention, session, rng, report: Callable[[str], None]) -> dict:
    """The sequences of BATCHED_CASE stepped together, one row a step, each from its own point (a late joiner: the
    longer ones start with a prompt), their pasts padded on the left: each sequence's rows against eager's causal
    answer for it alone."""
    tolerance = TOLERANCES["fp32"]
    heads, d_k = module.num_heads, module.d_k
    sequences, wants = [], []
    for batch, length in BATCHED_CASE:
        x = rng.standard_normal((batch, length, module.d_model), dtype=np.float32)
        causal = torch.tril(torch.ones(length, length, dtype=torch.bool))[None]
        with torch.no_grad():
            wants.append(tuple(t.numpy() for t in module(torch.from_numpy(x), mask=causal)))
        empty = np.zeros((batch, heads, 0, d_k), np.float32)
        sequences.append({"x": x, "position": 0, "key": empty, "value": empty})
    shortest = min(length for _, length in BATCHED_CASE)
    # Each starts with a prompt that leaves it shortest rows from its end, so that they all end together.
    for sequence, (_, length) in zip(sequences, BATCHED_CASE, strict=True):
        prompt = length - shortest + 1
        feed = {signature.QUERY: sequence["x"][:, :prompt], PAST_KEY: sequence["key"], PAST_VALUE: sequence["value"],
                PAST_LENGTHS: np.zeros(sequence["x"].shape[0], np.int64)}  # fmt: skip
        _, _, sequence["key"], sequence["value"] = session.run(None, feed)
        sequence["position"] = prompt
    output_error = weights_error = 0.0
    steps = 0
    while sequences[0]["position"] < sequences[0]["x"].shape[1]:
        keys, lengths = padded_pasts([s["key"] for s in sequences])
        values, _ = padded_pasts([s["value"] for s in sequences])
        rows = np.concatenate([s["x"][:, s["position"] : s["position"] + 1] for s in sequences])
        feed = {signature.QUERY: rows, PAST_KEY: keys, PAST_VALUE: values, PAST_LENGTHS: lengths}
        output, weights, present_key, present_value = session.run(None, feed)
        first = 0
        for sequence, (want_output, want_weights) in zip(sequences, wants, strict=True):
            where = (first, sequence["x"].shape[0], sequence["position"], keys.shape[2])
            _, batch, position, _ = where
            got_output, got_weights = output[first : first + batch], own_weights(weights, *where)
            want_row = want_output[:, position : position + 1]
            output_error = max(output_error, float(np.abs(got_output - want_row).max()))
            want_row = want_weights[:, :, position : position + 1, : position + 1]
            weights_error = max(weights_error, float(np.abs(got_weights - want_row).max()))
            sequence["key"], sequence["value"] = own_cache(present_key, *where), own_cache(present_value, *where)
            sequence["position"] += 1
            first += batch
        steps += 1
    scale = max(float(np.abs(want[0]).max()) for want in wants)
    held = tolerance.output.allows(output_error, output_error / scale) and tolerance.weights.allows(weights_error, 1.0)
    status = "pass" if held else "FAIL"
    shapes = ", ".join(f"B={b} L={n}" for b, n in BATCHED_CASE)
    report(f"step graph: sequences {shapes} stepped together in {steps} batched steps, pasts padded: output abs "
           f"{output_error:.1e}  attn abs {weights_error:.1e}  {status}")  # fmt: skip
    return {"batched": [list(case) for case in BATCHED_CASE], "steps": steps, "output_max_abs": output_error,
            "weights_max_abs": weights_error, "status": status}  # fmt: skip
