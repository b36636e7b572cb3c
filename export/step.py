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
warning on every run about its weights' inferred shape (measured
when it was chosen).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
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
    grouped_feed,
    grouped_members,
    member,
    own_weights,
    stacked_pasts,
    steps_grouped,
    with_rows,
)
from mhaserve.model import MultiHeadAttention

from .output_only import _constant, _linear
from .validate import TOLERANCES, validation_session

OPSET = 18


def _heads(source: str, target: str, heads: int, d_k: int) -> list:
    """[B, L, d] -> [B, h, L, d_k]."""
    return [
        make.make_node("Reshape", [source, "heads_shape"], [f"{target}.split"]),
        make.make_node("Transpose", [f"{target}.split"], [target], perm=[0, 2, 1, 3]),
    ]


def _shared_constants(d: int, heads: int, d_k: int, cross: bool) -> list:
    constants = [
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
    return constants if cross else [*constants, _constant("axis_1", [1], np.int64)]  # the causal order's


def _projected(module: MultiHeadAttention, sources: tuple[str, str, str], heads: int, d_k: int) -> tuple[list, list]:
    """Initializers and nodes: ``q``, NEW_KEY and NEW_VALUE [B, h, n, d_k] from the three sources [B, n, d]."""
    initializers, nodes = [], []
    for (name, target), source in zip((("W_q", "q_flat"), ("W_k", "k_flat"), ("W_v", "v_flat")), sources, strict=True):
        more, steps = _linear(module, name, source, target)
        initializers += more
        nodes += steps
    nodes += _heads("q_flat", "q", heads, d_k) + _heads("k_flat", NEW_KEY, heads, d_k)
    nodes += _heads("v_flat", NEW_VALUE, heads, d_k)
    return initializers, nodes


def _attended(at: Callable[[str], str], query: str, cross: bool) -> list:
    """Nodes: one sequence's attention (at(name): its tensor of that name), from its ``q``, NEW_KEY, NEW_VALUE and
    its past inputs to its ATTN_WEIGHTS and ``context_heads`` [B, h, n, d_k]; ``query``: the input whose rows are
    the step's (its length orders self-attention's new keys causally)."""
    nodes = [
        # The past's scores [B, h, n, C]: batch row b may attend its first past_lengths[b] keys.
        make.make_node("Transpose", [at(PAST_KEY)], [at("past_key_t")], perm=[0, 1, 3, 2]),
        make.make_node("MatMul", [at("q"), at("past_key_t")], [at("past_scores_raw")]),
        make.make_node("Mul", [at("past_scores_raw"), "scale"], [at("past_scores")]),
        make.make_node("Shape", [at(PAST_KEY)], [at("capacity_1")], start=2, end=3),
        make.make_node("Squeeze", [at("capacity_1"), "axis_0"], [at("capacity")]),
        make.make_node("Range", ["zero", at("capacity"), "one"], [at("past_positions")]),
        make.make_node("Reshape", [at(PAST_LENGTHS), "per_batch_row"], [at("own_length")]),
        make.make_node("Less", [at("past_positions"), at("own_length")], [at("own")]),
        make.make_node("Where", [at("own"), "no_bias", "masked_bias"], [at("past_bias")]),
        make.make_node("Add", [at("past_scores"), at("past_bias")], [at("past_biased")]),
        # The new keys' scores [B, h, n, m]: self-attention's row i may attend new keys 0 .. i.
        make.make_node("Transpose", [at(NEW_KEY)], [at("new_key_t")], perm=[0, 1, 3, 2]),
        make.make_node("MatMul", [at("q"), at("new_key_t")], [at("new_scores_raw")]),
        make.make_node("Mul", [at("new_scores_raw"), "scale"], [at("new_biased" if cross else "new_scores")]),
    ]
    if not cross:
        nodes += [
            make.make_node("Shape", [query], [at("new_length_1")], start=1, end=2),
            make.make_node("Squeeze", [at("new_length_1"), "axis_0"], [at("new_length")]),
            make.make_node("Range", ["zero", at("new_length"), "one"], [at("new_positions")]),
            make.make_node("Unsqueeze", [at("new_positions"), "axis_0"], [at("keys_row")]),
            make.make_node("Unsqueeze", [at("new_positions"), "axis_1"], [at("rows_column")]),
            make.make_node("LessOrEqual", [at("keys_row"), at("rows_column")], [at("causal")]),
            make.make_node("Where", [at("causal"), "no_bias", "masked_bias"], [at("new_bias")]),
            make.make_node("Add", [at("new_scores"), at("new_bias")], [at("new_biased")]),
        ]
    weights = at(signature.ATTN_WEIGHTS)
    return nodes + [
        make.make_node("Concat", [at("past_biased"), at("new_biased")], [at("biased")], axis=-1),
        make.make_node("Softmax", [at("biased")], [weights], axis=-1),
        make.make_node("Slice", [weights, "start", at("capacity_1"), "last_axis"], [at("past_weights")]),
        make.make_node("Slice", [weights, at("capacity_1"), "to_the_end", "last_axis"], [at("new_weights")]),
        make.make_node("MatMul", [at("past_weights"), at(PAST_VALUE)], [at("past_context")]),
        make.make_node("MatMul", [at("new_weights"), at(NEW_VALUE)], [at("new_context")]),
        make.make_node("Add", [at("past_context"), at("new_context")], [at("context_heads")]),
    ]


def _output(module: MultiHeadAttention) -> tuple[list, list]:
    """Initializers and nodes: OUTPUT [B, n, d] from ``context_heads`` [B, h, n, d_k]."""
    initializers, nodes = _linear(module, "W_o", "context", signature.OUTPUT)
    merged = [
        make.make_node("Transpose", ["context_heads"], ["context_split"], perm=[0, 2, 1, 3]),
        make.make_node("Reshape", ["context_split", "merged_shape"], ["context"]),
    ]
    return initializers, merged + nodes


def _past_inputs(at: Callable[[str], str], batch: str, capacity: str, heads: int, d_k: int) -> list:
    return [
        make.make_tensor_value_info(at(PAST_KEY), TensorProto.FLOAT, [batch, heads, capacity, d_k]),
        make.make_tensor_value_info(at(PAST_VALUE), TensorProto.FLOAT, [batch, heads, capacity, d_k]),
        make.make_tensor_value_info(at(PAST_LENGTHS), TensorProto.INT64, [batch]),
    ]


def step_graph(module: MultiHeadAttention, cross: bool = False) -> onnx.ModelProto:
    """The self-attention step graph (above); with ``cross``, the cross-attention one: its new keys and values come
    from inputs ``key``/``value`` [B, m, d] (m may be 0: a step of queries alone), and each query row attends to
    every key of its own, past and new (no causal order between queries and keys)."""
    module = module.eval()
    d, heads, d_k = module.d_model, module.num_heads, module.d_k
    sources = (signature.QUERY, signature.KEY, signature.VALUE) if cross else (signature.QUERY,) * 3
    initializers, nodes = _projected(module, sources, heads, d_k)
    nodes += _attended(lambda name: name, signature.QUERY, cross)
    more, steps = _output(module)
    initializers += _shared_constants(d, heads, d_k, cross) + more
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
        *_past_inputs(lambda name: name, "batch", "capacity", heads, d_k),
    ]
    outputs = [
        make.make_tensor_value_info(signature.OUTPUT, TensorProto.FLOAT, ["batch", "new", d]),
        make.make_tensor_value_info(signature.ATTN_WEIGHTS, TensorProto.FLOAT, ["batch", heads, "new", "all"]),
        make.make_tensor_value_info(NEW_KEY, TensorProto.FLOAT, ["batch", heads, new_keys, d_k]),
        make.make_tensor_value_info(NEW_VALUE, TensorProto.FLOAT, ["batch", heads, new_keys, d_k]),
    ]
    graph = make.make_graph(nodes, "mha_cross_step" if cross else "mha_step", inputs, outputs, initializers)
    return make.make_model(graph, opset_imports=[make.make_opsetid("", OPSET)], ir_version=10)


def grouped_step_graph(module: MultiHeadAttention, members: int | None = None, cross: bool = False) -> onnx.ModelProto:
    """Steps of ``members`` sequences in one run (by default steps_grouped of the module's width), each over its own
    buffers as they lie: inputs ``query_i`` [B_i, n, d] (every member the same n), ``past_key_i``/``past_value_i``
    [B_i, h, C_i, d_k] and ``past_lengths_i`` [B_i] (contract/steps.py member), and with ``cross`` ``key_i``/
    ``value_i`` [B_i, m, d], the keys each step adds (every member the same m, which may be 0); outputs ``output``
    and ``new_key``/``new_value`` for the members' rows in order, and ``attn_weights_i`` [B_i, h, n, C_i + n (or m)]
    each. Each member's attention is the step graph's (self-attention, or with ``cross`` cross-attention). The
    projections run once for every member's rows (the weights read once a run), each member's attention on its own
    past: no past is copied. A member of batch 0 takes no part (a run of fewer steps)."""
    module = module.eval()
    d, heads, d_k = module.d_model, module.num_heads, module.d_k
    members = members or steps_grouped(d)
    ats = [lambda name, i=i: member(name, i) for i in range(members)]
    given = (signature.QUERY, signature.KEY, signature.VALUE) if cross else (signature.QUERY,)
    nodes = [make.make_node("Concat", [at(name) for at in ats], [f"{name}_all"], axis=0) for name in given]
    for at in ats:
        nodes.append(make.make_node("Shape", [at(signature.QUERY)], [at("batch")], start=0, end=1))
    nodes.append(make.make_node("Concat", [at("batch") for at in ats], ["batches"], axis=0))
    sources = tuple(f"{name}_all" for name in given) if cross else (f"{signature.QUERY}_all",) * 3
    initializers, projected = _projected(module, sources, heads, d_k)
    nodes += projected
    for name in ("q", NEW_KEY, NEW_VALUE):
        nodes.append(make.make_node("Split", [name, "batches"], [at(name) for at in ats], axis=0))
    for at in ats:
        nodes += _attended(at, at(signature.QUERY), cross)
    nodes.append(make.make_node("Concat", [at("context_heads") for at in ats], ["context_heads"], axis=0))
    more, steps = _output(module)
    initializers += _shared_constants(d, heads, d_k, cross) + more
    nodes += steps
    new_keys = "new_keys" if cross else "new"
    inputs, outputs = [], [make.make_tensor_value_info(signature.OUTPUT, TensorProto.FLOAT, ["rows", "new", d])]
    for i, at in enumerate(ats):
        batch = f"batch_{i}"
        for name in given:
            rows = "new" if name == signature.QUERY else "new_keys"
            inputs.append(make.make_tensor_value_info(at(name), TensorProto.FLOAT, [batch, rows, d]))
        inputs += _past_inputs(at, batch, f"capacity_{i}", heads, d_k)
        outputs.append(make.make_tensor_value_info(at(signature.ATTN_WEIGHTS), TensorProto.FLOAT,
                                                   [batch, heads, "new", f"all_{i}"]))  # fmt: skip
    outputs += [make.make_tensor_value_info(name, TensorProto.FLOAT, ["rows", heads, new_keys, d_k])
                for name in (NEW_KEY, NEW_VALUE)]  # fmt: skip
    name = "mha_grouped_cross_steps" if cross else "mha_grouped_steps"
    graph = make.make_graph(nodes, name, inputs, outputs, initializers)
    return make.make_model(graph, opset_imports=[make.make_opsetid("", OPSET)], ir_version=10)


# (batch, sequence length) of the sequences a step graph is validated on, each cut into random steps of 1-8 rows.
STEP_CASES = ((1, 23), (2, 40), (3, 64))
MAX_STEP_ROWS = 8
# Sequences (batch, length) stepped together in one batch, their pasts of different lengths side by side.
BATCHED_CASE = ((1, 30), (2, 17), (1, 41))
# Sequences (batch, length) stepped together by the grouped step graph, each over its own buffers; the graph's other
# members empty.
GROUPED_CASE = ((1, 30), (2, 17), (1, 41), (1, 9), (3, 12))
# Cross-attention sequences (batch, query rows, keys): the keys given in chunks of 1-16 with some of the steps (the
# first step's among them), the queries in random steps of 1-8 rows.
CROSS_CASES = ((1, 19, 23), (2, 33, 40))
MAX_KEY_CHUNK = 16
# Cross-attention sequences (batch, keys) stepped together, one query row a step, their keys given at the start.
CROSS_BATCHED_CASE = ((1, 12), (2, 30), (1, 7))
CROSS_BATCHED_STEPS = 6
# Keys each cross-attention sequence adds at one of its steps in the grouped cross step graph's validation.
GROUPED_CROSS_KEYS = 3


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
    session = validation_session(graph)
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
        held = tolerance.output.allows(self.output, self.output / (self.scale or 1.0)) and tolerance.weights.allows(
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


def _causal_sequences(module: MultiHeadAttention, rng, cases) -> tuple[list[_Steps], list[tuple]]:
    """A random sequence of each (batch, length) in ``cases``, kept as the server keeps it, and eager PyTorch's
    causal answer for each."""
    sequences, wants = [], []
    for batch, length in cases:
        x = rng.standard_normal((batch, length, module.d_model), dtype=np.float32)
        wants.append(_causal(module, x))
        sequences.append(_Steps(x, module.num_heads, module.d_k))
    return sequences, wants


def _validate_batched(module: MultiHeadAttention, session, rng, report: Callable[[str], None]) -> dict:
    """The sequences of BATCHED_CASE stepped together, one row a step, each from its own point (a late joiner: the
    longer ones start with a prompt), their pasts side by side in one batch: each sequence's rows against eager's
    causal answer for it alone."""
    sequences, wants = _causal_sequences(module, rng, BATCHED_CASE)
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


def validate_grouped_steps(
    module: MultiHeadAttention, graph: bytes | str, seed: int | None, report: Callable[[str], None]
) -> list[dict]:
    """The sequences of GROUPED_CASE in the grouped step graph: each started with a prompt in a run of its own (the
    other members empty) that leaves it as many rows to go as the shortest, then stepped together one row a step,
    each over its own buffers with room (contract/steps.py): every step's rows against eager PyTorch's causal
    answer for that sequence alone."""
    session = validation_session(graph)
    rng = np.random.default_rng(seed)
    sequences, wants = _causal_sequences(module, rng, GROUPED_CASE)
    shortest = min(length for _, length in GROUPED_CASE)
    errors = _Errors()

    def run(stepping: list[int], rows: int) -> None:
        """One run: ``rows`` rows of each sequence numbered in ``stepping``, each checked, then grown."""
        at = [sequences[number].position for number in stepping]
        answers = _run_grouped(session, [sequences[number] for number in stepping], rows)
        for number, position, (output, weights) in zip(stepping, at, answers, strict=True):
            want_output, want_weights = wants[number]
            end = position + rows
            errors.add(output, want_output[:, position:end], weights, want_weights[:, :, position:end, :end])

    for number, (_, length) in enumerate(GROUPED_CASE):
        run([number], length - shortest + 1)
    for _ in range(shortest - 1):
        run(list(range(len(GROUPED_CASE))), 1)
    shapes = ", ".join(f"B={b} L={n}" for b, n in GROUPED_CASE)
    what = (f"grouped step graph: sequences {shapes} each after a prompt of its own, then stepped together in "
            f"{shortest - 1} runs, each over its own buffers")  # fmt: skip
    return [errors.reported(report, what, {"grouped": [list(c) for c in GROUPED_CASE], "steps": shortest - 1})]


def validate_grouped_cross_steps(
    module: MultiHeadAttention, graph: bytes | str, seed: int | None, report: Callable[[str], None]
) -> list[dict]:
    """The cross-attention sequences of CROSS_BATCHED_CASE in the grouped cross step graph: each given its keys with
    its first step in a run of its own, then stepped together, one query row a step, adding GROUPED_CROSS_KEYS keys
    each at one of the steps: every step's rows against eager PyTorch's answer over every key given so far."""
    session = validation_session(graph)
    rng = np.random.default_rng(seed)
    d, sequences, errors = module.d_model, [], _Errors()
    for batch, kv_len in CROSS_BATCHED_CASE:
        x = rng.standard_normal((batch, CROSS_BATCHED_STEPS + 1, d), dtype=np.float32)
        keys, values = (rng.standard_normal((batch, kv_len + GROUPED_CROSS_KEYS, d), dtype=np.float32) for _ in "kv")
        sequences.append(_Steps(x, module.num_heads, module.d_k, keys, values))

    def run(stepping: list[_Steps], new_keys: int) -> None:
        at = [(s.position, s.length + new_keys) for s in stepping]
        answers = _run_grouped(session, stepping, 1, new_keys)
        for sequence, (position, held), (output, weights) in zip(stepping, at, answers, strict=True):
            want_output, want_weights = _eager(module, sequence.x[:, position : position + 1],
                                               sequence.keys[:, :held], sequence.values[:, :held])  # fmt: skip
            errors.add(output, want_output, weights, want_weights)

    for sequence, (_, kv_len) in zip(sequences, CROSS_BATCHED_CASE, strict=True):
        run([sequence], kv_len)  # its keys with its first step
    for number in range(CROSS_BATCHED_STEPS):
        run(sequences, GROUPED_CROSS_KEYS if number == CROSS_BATCHED_STEPS // 2 else 0)
    shapes = ", ".join(f"B={b} Lk={n}" for b, n in CROSS_BATCHED_CASE)
    what = (f"grouped cross step graph: sequences {shapes} stepped together in {CROSS_BATCHED_STEPS} runs, one adding "
            f"{GROUPED_CROSS_KEYS} keys each")  # fmt: skip
    case = {"grouped": [list(c) for c in CROSS_BATCHED_CASE], "steps": CROSS_BATCHED_STEPS}
    return [errors.reported(report, what, case)]


def _run_grouped(session, sequences: list[_Steps], rows: int, new_keys: int = 0) -> list[tuple]:
    """One run of a grouped step graph: ``rows`` query rows (and ``new_keys`` keys) of each of ``sequences``, each
    over its own buffers, then each grown; each one's output rows and its weights over its own keys."""
    members = grouped_members(i.name for i in session.get_inputs())
    feeds = [sequence.feed(rows, new_keys) for sequence in sequences]
    outputs = dict(zip((o.name for o in session.get_outputs()), session.run(None, grouped_feed(feeds, members)),
                       strict=True))  # fmt: skip
    answers, first = [], 0
    for slot, sequence in enumerate(sequences):
        batch, held, capacity = sequence.x.shape[0], sequence.length, sequence.key.shape[2]
        own = slice(first, first + batch)
        weights = own_weights(outputs[member(signature.ATTN_WEIGHTS, slot)], 0, batch, held, capacity)
        answers.append((outputs[signature.OUTPUT][own], weights))
        sequence.grow(rows, outputs[NEW_KEY][own], outputs[NEW_VALUE][own], own_rows=False)
        first += batch
    return answers


def validate_cross_steps(
    module: MultiHeadAttention, graph: bytes | str, seed: int | None, report: Callable[[str], None]
) -> list[dict]:
    """Each case's keys and values given in chunks with some of its steps, its queries in random steps, the
    sequence kept as the server keeps it: every step's output and weight rows against eager PyTorch's answer for
    those rows over every key given so far (float32's tolerance); then sequences with keys of different lengths
    stepped together."""
    session = validation_session(graph)
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


def step_graphs(module: MultiHeadAttention) -> dict[str, onnx.ModelProto]:
    """Every step graph a float32 export writes, by its manifest key (contract/model_dir.py STEP_FILES)."""
    return {
        "step": step_graph(module),
        "cross_step": step_graph(module, cross=True),
        "grouped_step": grouped_step_graph(module),
        "grouped_cross_step": grouped_step_graph(module, cross=True),
    }


# How each step graph is validated, by its manifest key: (module, graph, seed, report) -> its cases' results.
STEP_VALIDATIONS = {
    "step": validate_steps,
    "cross_step": validate_cross_steps,
    "grouped_step": validate_grouped_steps,
    "grouped_cross_step": validate_grouped_cross_steps,
}
