"""The step graph: one step of a growing sequence, attending over the keys and values the server keeps.

Inputs: ``query`` [B, n, d], the step's new rows (self-attention: they are the new keys and values too),
``past_key``/``past_value`` [B, h, C, d_k], buffers holding the projected keys and values of the rows before them,
and ``past_lengths`` [B], how many of those C rows are each batch row's own: its first ones; the rest, on the
right, are room the cache has not yet filled (or padding, where steps of sequences of different lengths run as one
batch), masked. Outputs: ``output`` [B, n, d] and ``attn_weights`` [B, h, n, C + n] for the new rows (row b's
weights over its own keys are its first past_lengths[b] columns and its last n; the others are exactly 0), and
``new_key``/``new_value`` [B, h, n, d_k], the new rows' projected keys and values, which the server writes into
its buffers at each sequence's position: a step writes its own rows, never the cache it reads. Row i of the step
attends to every past row of its own and causally among the new ones: a decoder's self-attention, so the steps'
answers, put together, equal the stateless answer for the whole sequence under a causal mask (validated against
eager PyTorch, alone and batched with other sequences, as every graph of an export is: validate_steps).

The past's scores and the new rows' are computed apart and joined (an n x (C + n) block per head), and the values
weighted in two products, so that no step concatenates the cache with its rows.

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
from mhaserve.contract.steps import (
    NEW_KEY,
    NEW_VALUE,
    PAST_KEY,
    PAST_LENGTHS,
    PAST_VALUE,
    own_weights,
    stacked_pasts,
    with_rows,
)
from mhaserve.model import MultiHeadAttention

from .output_only import _constant, _linear
from .validate import TOLERANCES

OPSET = 18


def _heads(source: str, target: str, heads: int, d_k: int) -> list:
    """[B, L, d] -> [B, h, L, d_k]."""
    return [
        make.make_node("Reshape", [source, "heads_shape"], [f"{target}.split"]),
        make.make_node("Transpose", [f"{target}.split"], [target], perm=[0, 2, 1, 3]),
    ]


def step_graph(module: MultiHeadAttention, cross: bool = False) -> onnx.ModelProto:
    """The self-attention step graph (above); with ``cross``, the cross-attention one: its new keys and values come
    from inputs ``key``/``value`` [B, m, d] (m may be 0: a step of queries alone), and each query row attends to
    every key of its own, past and new (no causal order between queries and keys)."""
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
        _constant("last_axis", [-1], np.int64),
        _constant("start", [0], np.int64),
        _constant("to_the_end", [np.iinfo(np.int64).max], np.int64),
        _constant("per_batch_row", [-1, 1, 1, 1], np.int64),
    ]
    if not cross:
        initializers.append(_constant("axis_1", [1], np.int64))
    nodes = []
    sources = (signature.QUERY, signature.KEY, signature.VALUE) if cross else (signature.QUERY,) * 3
    for (name, target), source in zip((("W_q", "q_flat"), ("W_k", "k_flat"), ("W_v", "v_flat")), sources, strict=True):
        more, steps = _linear(module, name, source, target)
        initializers += more
        nodes += steps
    nodes += _heads("q_flat", "q", heads, d_k) + _heads("k_flat", NEW_KEY, heads, d_k)
    nodes += _heads("v_flat", NEW_VALUE, heads, d_k)
    nodes += [
        # The past's scores [B, h, n, C]: batch row b may attend its first past_lengths[b] keys.
        make.make_node("Transpose", [PAST_KEY], ["past_key_t"], perm=[0, 1, 3, 2]),
        make.make_node("MatMul", ["q", "past_key_t"], ["past_scores_raw"]),
        make.make_node("Mul", ["past_scores_raw", "scale"], ["past_scores"]),
        make.make_node("Shape", [PAST_KEY], ["capacity_1"], start=2, end=3),
        make.make_node("Squeeze", ["capacity_1", "axis_0"], ["capacity"]),
        make.make_node("Range", ["zero", "capacity", "one"], ["past_positions"]),
        make.make_node("Reshape", [PAST_LENGTHS, "per_batch_row"], ["own_length"]),
        make.make_node("Less", ["past_positions", "own_length"], ["own"]),
        make.make_node("Where", ["own", "no_bias", "masked_bias"], ["past_bias"]),
        make.make_node("Add", ["past_scores", "past_bias"], ["past_biased"]),
        # The new keys' scores [B, h, n, m]: self-attention's row i may attend new keys 0 .. i.
        make.make_node("Transpose", [NEW_KEY], ["new_key_t"], perm=[0, 1, 3, 2]),
        make.make_node("MatMul", ["q", "new_key_t"], ["new_scores_raw"]),
        make.make_node("Mul", ["new_scores_raw", "scale"], ["new_scores" if not cross else "new_biased"]),
    ]
    if not cross:
        nodes += [
            make.make_node("Shape", [signature.QUERY], ["new_length_1"], start=1, end=2),
            make.make_node("Squeeze", ["new_length_1", "axis_0"], ["new_length"]),
            make.make_node("Range", ["zero", "new_length", "one"], ["new_positions"]),
            make.make_node("Unsqueeze", ["new_positions", "axis_0"], ["keys_row"]),
            make.make_node("Unsqueeze", ["new_positions", "axis_1"], ["rows_column"]),
            make.make_node("LessOrEqual", ["keys_row", "rows_column"], ["causal"]),
            make.make_node("Where", ["causal", "no_bias", "masked_bias"], ["new_bias"]),
            make.make_node("Add", ["new_scores", "new_bias"], ["new_biased"]),
        ]
    nodes += [
        make.make_node("Concat", ["past_biased", "new_biased"], ["biased"], axis=-1),
        make.make_node("Softmax", ["biased"], [signature.ATTN_WEIGHTS], axis=-1),
        make.make_node("Slice", [signature.ATTN_WEIGHTS, "start", "capacity_1", "last_axis"], ["past_weights"]),
        make.make_node("Slice", [signature.ATTN_WEIGHTS, "capacity_1", "to_the_end", "last_axis"], ["new_weights"]),
        make.make_node("MatMul", ["past_weights", PAST_VALUE], ["past_context"]),
        make.make_node("MatMul", ["new_weights", NEW_VALUE], ["new_context"]),
        make.make_node("Add", ["past_context", "new_context"], ["context_heads"]),
        make.make_node("Transpose", ["context_heads"], ["context_split"], perm=[0, 2, 1, 3]),
        make.make_node("Reshape", ["context_split", "merged_shape"], ["context"]),
    ]
    more, steps = _linear(module, "W_o", "context", signature.OUTPUT)
    initializers += more
    nodes += steps
    given = [signature.QUERY, signature.KEY, signature.VALUE] if cross else [signature.QUERY]
    new_keys = "new_keys" if cross else "new"
    inputs = [
        *(
            make.make_tensor_value_info(
                name, TensorProto.FLOAT, ["batch", "new" if name == signature.QUERY else "new_keys", d]
            )
            for name in given
        ),  # fmt: skip
        make.make_tensor_value_info(PAST_KEY, TensorProto.FLOAT, ["batch", heads, "capacity", d_k]),
        make.make_tensor_value_info(PAST_VALUE, TensorProto.FLOAT, ["batch", heads, "capacity", d_k]),
        make.make_tensor_value_info(PAST_LENGTHS, TensorProto.INT64, ["batch"]),
    ]
    outputs = [
        make.make_tensor_value_info(signature.OUTPUT, TensorProto.FLOAT, ["batch", "new", d]),
        make.make_tensor_value_info(signature.ATTN_WEIGHTS, TensorProto.FLOAT, ["batch", heads, "new", "all"]),
        make.make_tensor_value_info(NEW_KEY, TensorProto.FLOAT, ["batch", heads, new_keys, d_k]),
        make.make_tensor_value_info(NEW_VALUE, TensorProto.FLOAT, ["batch", heads, new_keys, d_k]),
    ]
    graph = make.make_graph(nodes, "mha_cross_step" if cross else "mha_step", inputs, outputs, initializers)
    return make.make_model(graph, opset_imports=[make.make_opsetid("", OPSET)], ir_version=10)


# (batch, sequence length) of the sequences a step graph is validated on, each cut into random steps of 1-8 rows.
STEP_CASES = ((1, 23), (2, 40), (3, 64))
MAX_STEP_ROWS = 8
# Sequences (batch, length) stepped together in one batch, their pasts of different lengths side by side.
BATCHED_CASE = ((1, 30), (2, 17), (1, 41))
# Cross-attention sequences (batch, query rows, keys): the keys given in chunks of 1-16 with some of the steps (the
# first step's among them), the queries in random steps of 1-8 rows.
CROSS_CASES = ((1, 19, 23), (2, 33, 40))
MAX_KEY_CHUNK = 16
# Cross-attention sequences (batch, keys) stepped together, one query row a step, their keys given at the start.
CROSS_BATCHED_CASE = ((1, 12), (2, 30), (1, 7))
CROSS_BATCHED_STEPS = 6


class _Steps:
    """One sequence stepped as the server steps it: its keys and values in buffers with room to grow
    (contract/steps.py), each step's new rows written after those it holds. A self-attention sequence's query rows
    are its keys and values too; a cross-attention one's keys and values come in their own rows, ``keys`` and
    ``values``."""

    def __init__(self, x: np.ndarray, heads: int, d_k: int, keys=None, values=None):
        self.x, self.keys, self.values = x, keys, values
        self.position = 0  # query rows stepped
        self.length = 0  # keys held
        self.key = np.zeros((x.shape[0], heads, 0, d_k), np.float32)
        self.value = self.key.copy()

    def feed(self, rows: int, new_keys: int = 0) -> dict[str, np.ndarray]:
        query = self.x[:, self.position : self.position + rows]
        lengths = np.full(self.x.shape[0], self.length, np.int64)
        feed = {signature.QUERY: query, PAST_KEY: self.key, PAST_VALUE: self.value, PAST_LENGTHS: lengths}
        if self.keys is not None:
            feed[signature.KEY] = self.keys[:, self.length : self.length + new_keys]
            feed[signature.VALUE] = self.values[:, self.length : self.length + new_keys]
        return feed

    def grow(self, rows: int, new_key: np.ndarray, new_value: np.ndarray, own_rows: bool = True) -> None:
        self.key = with_rows(self.key, self.length, new_key, own_rows)
        self.value = with_rows(self.value, self.length, new_value, own_rows)
        self.length += new_key.shape[2]
        self.position += rows


def validate_steps(
    module: MultiHeadAttention, graph: bytes | str, seed: int | None, report: Callable[[str], None]
) -> list[dict]:
    """Each case's sequence fed to the step graph in random steps from an empty cache, its keys and values kept as
    the server keeps them, every step's output rows and weight rows against eager PyTorch's causal answer for the
    whole sequence (float32's tolerance)."""
    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    results = []
    for number, (batch, length) in enumerate(STEP_CASES, 1):
        x = rng.standard_normal((batch, length, module.d_model), dtype=np.float32)
        want_output, want_weights = _causal(module, x)
        sequence = _Steps(x, module.num_heads, module.d_k)
        errors, steps = _Errors(), []
        while (position := sequence.position) < length:
            rows = min(int(rng.integers(1, MAX_STEP_ROWS + 1)), length - position)
            capacity = sequence.key.shape[2]
            output, weights, new_key, new_value = session.run(None, sequence.feed(rows))
            end = position + rows
            errors.add(output, want_output[:, position:end], own_weights(weights, 0, batch, position, capacity),
                       want_weights[:, :, position:end, :end])  # fmt: skip
            sequence.grow(rows, new_key, new_value)
            steps.append(rows)
        results.append(errors.reported(report, f"step graph: [{number}/{len(STEP_CASES)}] B={batch} L={length} in "
                                               f"{len(steps)} steps of 1-{MAX_STEP_ROWS} rows",
                                       {"batch": batch, "length": length, "steps": steps}))  # fmt: skip
    results.append(_validate_batched(module, session, rng, report))
    return results


class _Errors:
    """The largest differences from eager of a case's outputs and weights, and its verdict at float32's tolerance."""

    def __init__(self):
        self.output = self.weights = self.scale = 0.0

    def add(self, output, want_output, weights, want_weights) -> None:
        self.output = max(self.output, float(np.abs(output - want_output).max()))
        self.weights = max(self.weights, float(np.abs(weights - want_weights).max()))
        self.scale = max(self.scale, float(np.abs(want_output).max()))

    def reported(self, report: Callable[[str], None], what: str, case: dict) -> dict:
        tolerance = TOLERANCES["fp32"]
        held = tolerance.output.allows(self.output, self.output / self.scale) and tolerance.weights.allows(
            self.weights, 1.0
        )
        status = "pass" if held else "FAIL"
        report(f"{what}: output abs {self.output:.1e}  attn abs {self.weights:.1e}  {status}")
        return {**case, "output_max_abs": self.output, "weights_max_abs": self.weights, "status": status}


def _causal(module: MultiHeadAttention, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Eager PyTorch's answer for the whole sequence under a causal mask."""
    length = x.shape[1]
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool))[None]
    with torch.no_grad():
        output, weights = module(torch.from_numpy(x), mask=causal)
    return output.numpy(), weights.numpy()


def _eager(module: MultiHeadAttention, query: np.ndarray, keys: np.ndarray, values: np.ndarray):
    """Eager PyTorch's answer for ``query``'s rows over every key given, no mask."""
    with torch.no_grad():
        output, weights = module(*(torch.from_numpy(np.ascontiguousarray(a)) for a in (query, keys, values)))
    return output.numpy(), weights.numpy()


def _validate_batched(module: MultiHeadAttention, session, rng, report: Callable[[str], None]) -> dict:
    """The sequences of BATCHED_CASE stepped together, one row a step, each from its own point (a late joiner: the
    longer ones start with a prompt), their pasts side by side in one batch: each sequence's rows against eager's
    causal answer for it alone."""
    sequences, wants = [], []
    for batch, length in BATCHED_CASE:
        x = rng.standard_normal((batch, length, module.d_model), dtype=np.float32)
        wants.append(_causal(module, x))
        sequences.append(_Steps(x, module.num_heads, module.d_k))
    shortest = min(length for _, length in BATCHED_CASE)
    # Each starts with a prompt that leaves it shortest rows from its end, so that they all end together.
    for sequence, (_, length) in zip(sequences, BATCHED_CASE, strict=True):
        prompt = length - shortest + 1
        _, _, new_key, new_value = session.run(None, sequence.feed(prompt))
        sequence.grow(prompt, new_key, new_value)
    errors, steps = _Errors(), 0
    while sequences[0].position < sequences[0].x.shape[1]:
        at = [s.position for s in sequences]  # each one's row this step, its keys before it
        output, weights, capacity = _run_together(session, sequences, [{} for _ in sequences])
        first = 0
        for sequence, position, (want_output, want_weights) in zip(sequences, at, wants, strict=True):
            batch = sequence.x.shape[0]
            errors.add(output[first : first + batch], want_output[:, position : position + 1],
                       own_weights(weights, first, batch, position, capacity),
                       want_weights[:, :, position : position + 1, : position + 1])  # fmt: skip
            first += batch
        steps += 1
    shapes = ", ".join(f"B={b} L={n}" for b, n in BATCHED_CASE)
    what = f"step graph: sequences {shapes} stepped together in {steps} batched steps, pasts side by side"
    return errors.reported(report, what, {"batched": [list(c) for c in BATCHED_CASE], "steps": steps})


def _run_together(session, sequences: list[_Steps], given: list[dict]) -> tuple[np.ndarray, np.ndarray, int]:
    """One step of one query row for each of ``sequences`` as one run, their pasts side by side (``given``: each
    one's key and value rows, for cross-attention, none here); each grown by its rows. The run's output, weights
    and the capacity its pasts were stacked to."""
    keys, lengths = stacked_pasts([(s.key, s.length) for s in sequences])
    values, _ = stacked_pasts([(s.value, s.length) for s in sequences])
    rows = np.concatenate([s.x[:, s.position : s.position + 1] for s in sequences])
    feed = {signature.QUERY: rows, PAST_KEY: keys, PAST_VALUE: values, PAST_LENGTHS: lengths}
    for name in (signature.KEY, signature.VALUE):
        if given and name in given[0]:
            feed[name] = np.concatenate([g[name] for g in given])
    output, weights, new_key, new_value = session.run(None, feed)
    first = 0
    for sequence in sequences:
        batch = sequence.x.shape[0]
        own = slice(first, first + batch)
        sequence.grow(1, new_key[own], new_value[own], own_rows=False)
        first += batch
    return output, weights, keys.shape[2]


def validate_cross_steps(
    module: MultiHeadAttention, graph: bytes | str, seed: int | None, report: Callable[[str], None]
) -> list[dict]:
    """Each case's keys and values given in chunks with some of its steps, its queries in random steps, the
    sequence kept as the server keeps it: every step's output and weight rows against eager PyTorch's answer for
    those rows over every key given so far (float32's tolerance); then sequences with keys of different lengths
    stepped together."""
    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(seed)
    d = module.d_model
    results = []
    for number, (batch, q_len, kv_len) in enumerate(CROSS_CASES, 1):
        x, keys, values = (rng.standard_normal((batch, n, d), dtype=np.float32) for n in (q_len, kv_len, kv_len))
        sequence = _Steps(x, module.num_heads, module.d_k, keys, values)
        errors, steps = _Errors(), []
        while (position := sequence.position) < q_len:
            rows = min(int(rng.integers(1, MAX_STEP_ROWS + 1)), q_len - position)
            held = sequence.length
            chunk = 0 if held and (held == kv_len or rng.random() < 0.6) else int(rng.integers(1, MAX_KEY_CHUNK + 1))
            chunk = min(chunk, kv_len - held)
            capacity = sequence.key.shape[2]
            output, weights, new_key, new_value = session.run(None, sequence.feed(rows, chunk))
            want_output, want_weights = _eager(module, x[:, position : position + rows], keys[:, : held + chunk],
                                               values[:, : held + chunk])  # fmt: skip
            errors.add(output, want_output, own_weights(weights, 0, batch, held, capacity), want_weights)
            sequence.grow(rows, new_key, new_value)
            steps.append([rows, chunk])
        results.append(errors.reported(report, f"cross step graph: [{number}/{len(CROSS_CASES)}] B={batch} Lq={q_len} "
                                               f"Lk={kv_len} in {len(steps)} steps",
                                       {"batch": batch, "q_len": q_len, "kv_len": kv_len, "steps": steps}))  # fmt: skip
    results.append(_validate_cross_batched(module, session, rng, report))
    return results


def _validate_cross_batched(module: MultiHeadAttention, session, rng, report: Callable[[str], None]) -> dict:
    d, sequences = module.d_model, []
    for batch, kv_len in CROSS_BATCHED_CASE:
        x = rng.standard_normal((batch, CROSS_BATCHED_STEPS + 1, d), dtype=np.float32)
        keys, values = (rng.standard_normal((batch, kv_len, d), dtype=np.float32) for _ in range(2))
        sequence = _Steps(x, module.num_heads, module.d_k, keys, values)
        _, _, new_key, new_value = session.run(None, sequence.feed(1, kv_len))  # its keys with its first step
        sequence.grow(1, new_key, new_value)
        sequences.append(sequence)
    errors = _Errors()
    empty = [{name: s.keys[:, :0] for name in (signature.KEY, signature.VALUE)} for s in sequences]
    for _ in range(CROSS_BATCHED_STEPS):
        at = [s.position for s in sequences]
        output, weights, capacity = _run_together(session, sequences, empty)
        first = 0
        for sequence, position in zip(sequences, at, strict=True):
            batch = sequence.x.shape[0]
            want_output, want_weights = _eager(module, sequence.x[:, position : position + 1], sequence.keys,
                                               sequence.values)  # fmt: skip
            errors.add(output[first : first + batch], want_output,
                       own_weights(weights, first, batch, sequence.length, capacity), want_weights)  # fmt: skip
            first += batch
    shapes = ", ".join(f"B={b} Lk={n}" for b, n in CROSS_BATCHED_CASE)
    what = f"cross step graph: sequences {shapes} stepped together in {CROSS_BATCHED_STEPS} batched steps"
    case = {"batched": [list(c) for c in CROSS_BATCHED_CASE], "steps": CROSS_BATCHED_STEPS}
    return errors.reported(report, what, case)
