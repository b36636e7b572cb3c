"""The summaries graph: the exported full graph answering, beside the output, each head's query row summarised over
every key (signature.SUMMARY_OUTPUT_NAMES) instead of the weights, for requests that ask for the summaries alone.

The four reductions read the tensors the full graph computes anyway, the masked softmax's input (the scores with the
mask's bias) and its output: the entropy without a logarithm per weight, as ln Z + max(s) - sum(p * s) where the
row's largest weight is 1 / Z; the sink and the largest weight and its key from the softmax's output. So a summary
costs a few passes over the [Lq, Lk] weights inside the run, not their trip to numpy (BENCHMARKS.md, "Attention
summaries"). Validated against float64 summaries of the eager module (writer.py), like every exported graph.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx import helper as make

from mhaserve.contract.signature import (
    ATTN_ENTROPY,
    ATTN_MAX,
    ATTN_MAX_INDEX,
    ATTN_SINK,
    ATTN_WEIGHTS,
    OUTPUT,
    SUMMARY_OUTPUT_NAMES,
)

from .validate import EAGER_ERROR_FACTOR


def node(op: str, inputs: list[str], output: str, **attributes) -> onnx.NodeProto:
    """A node of the summaries graph, named after its one output."""
    return make.make_node(op, inputs, [output], name=f"summaries.{output}", **attributes)


def summaries_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (the float32 full graph) with the summaries as its outputs after ``output``, the weights no longer
    one: its one Softmax is the masked softmax, whose output times the row's "attends at all" factor is the
    weights. The weights are never made whole: the values are weighted by the softmax's output and a row attending
    no key is zeroed in the heads' context ([Lq, d_k], not [Lq, Lk])."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    (softmax,) = [node for node in graph.node if node.op_type == "Softmax"]
    (weighting,) = [node for node in graph.node if node.op_type == "Mul" and ATTN_WEIGHTS in node.output]
    (weighing_values,) = [node for node in graph.node if ATTN_WEIGHTS in node.input]
    scores, raw = softmax.input[0], softmax.output[0]
    attends = next(name for name in weighting.input if name != raw)
    graph.node.remove(weighting)
    context = weighing_values.output[0]
    weighing_values.input[list(weighing_values.input).index(ATTN_WEIGHTS)] = raw
    weighing_values.output[0] = "summaries.context_of_every_row"
    at = list(graph.node).index(weighing_values) + 1
    graph.initializer.extend([
        numpy_helper.from_array(np.array([-1], np.int64), "summaries.last_axis"),
        numpy_helper.from_array(np.array([0], np.int64), "summaries.first"),
        numpy_helper.from_array(np.array([1], np.int64), "summaries.second"),
        numpy_helper.from_array(np.array(0.0, np.float32), "summaries.zero"),
        numpy_helper.from_array(np.array(-1, np.int64), "summaries.none"),
    ])  # fmt: skip

    last = "summaries.last_axis"
    graph.node.insert(at, node("Mul", ["summaries.context_of_every_row", attends], context))
    # Two passes over [Lq, Lk], the cheapest measured in ONNX Runtime's CPU kernels (BENCHMARKS.md, "Attention
    # summaries"): the top key's search (by blocks where it can), the largest weight gathered at that key rather than
    # reduced again (the softmax keeps the scores' order), the sink sliced before it is weighted; and the weighted sum
    # of the scores for the entropy.
    graph.node.extend([
        node("Squeeze", [attends, last], "summaries.attends"),  # [B|1, h|1, Lq|1]: 0 on a row attending no key
        *top_key_and_score(scores, "summaries.top_key", "summaries.top_score_kept"),
        node("Squeeze", ["summaries.top_key", last], "summaries.largest_key"),
        node("Squeeze", ["summaries.top_score_kept", last], "summaries.top_score"),
        node("GatherElements", [raw, "summaries.top_key"], "summaries.largest_raw_kept", axis=-1),
        node("Squeeze", ["summaries.largest_raw_kept", last], "summaries.largest_raw"),  # the largest weight, 1 / Z
        node("Mul", [raw, scores], "summaries.weighted_scores"),
        node("ReduceSum", ["summaries.weighted_scores", last], "summaries.mean_score", keepdims=0),
        node("Log", ["summaries.largest_raw"], "summaries.minus_log_z"),
        node("Sub", ["summaries.top_score", "summaries.mean_score"], "summaries.spread"),
        node("Sub", ["summaries.spread", "summaries.minus_log_z"], "summaries.entropy_raw"),
        node("Mul", ["summaries.entropy_raw", "summaries.attends"], ATTN_ENTROPY),
        node("Mul", ["summaries.largest_raw", "summaries.attends"], ATTN_MAX),
        node("Greater", [ATTN_MAX, "summaries.zero"], "summaries.attending"),
        node("Where", ["summaries.attending", "summaries.largest_key", "summaries.none"], ATTN_MAX_INDEX),
        node("Slice", [raw, "summaries.first", "summaries.second", last], "summaries.first_key"),
        node("Squeeze", ["summaries.first_key", last], "summaries.first_key_raw"),
        node("Mul", ["summaries.first_key_raw", "summaries.attends"], ATTN_SINK),
    ])  # fmt: skip
    types = {ATTN_ENTROPY: TensorProto.FLOAT, ATTN_SINK: TensorProto.FLOAT, ATTN_MAX: TensorProto.FLOAT,
             ATTN_MAX_INDEX: TensorProto.INT64}  # fmt: skip
    kept = [output for output in graph.output if output.name == OUTPUT]
    del graph.output[:]
    graph.output.extend(kept)
    graph.output.extend(make.make_tensor_value_info(name, types[name], [None] * 3) for name in SUMMARY_OUTPUT_NAMES)
    return model


# Keys in a block of the top key's search: each row's blocks' largest scores are found first (ONNX Runtime's
# ReduceMax, vectorised), then the first block holding the top score, then the key within it; ArgMax over every key,
# a scalar loop, took about twice as long (BENCHMARKS.md, "Attention summaries"). The block is the width here that
# divides the row's keys into two blocks or more, the nearest to 40 first (24 to 64 keys a block searched fastest,
# measured at 480 and 500 keys); lengths with none (a prime number of keys, say) take ArgMax: padding the scores to
# whole blocks cost more than the search saves.
BLOCK_WIDTHS = tuple(sorted(range(24, 65), key=lambda width: (abs(width - 40), width)))


def top_key_and_score(scores: str, key: str, score: str) -> list[onnx.NodeProto]:
    """Nodes giving each row's first key of the largest score (``key``, ties to the lower key, as numpy's argmax)
    and that score (``score``), both [B, h, Lq, 1]: by blocks, the first of BLOCK_WIDTHS to divide Lk in two or
    more, else by ArgMax over every key."""

    def constant(name, value):
        return make.make_node("Constant", [], [name], name=f"summaries.{name}",
                              value=numpy_helper.from_array(np.array(value, np.int64), name))  # fmt: skip

    out = [make.make_tensor_value_info(key, TensorProto.INT64, None),
           make.make_tensor_value_info(score, TensorProto.FLOAT, None)]  # fmt: skip
    by_blocks = make.make_graph([
        node("ReduceProd", ["top_key.rows_shape"], "top_key.rows", keepdims=1),  # [B * h * Lq]
        node("Concat", ["top_key.rows", "top_key.last", "top_key.width"], "top_key.blocks_shape", axis=0),
        node("Reshape", [scores, "top_key.blocks_shape"], "top_key.blocks"),  # [N, Lk / block, block]
        node("ReduceMax", ["top_key.blocks", "top_key.last"], "top_key.block_tops", keepdims=0),  # [N, Lk / block]
        node("ArgMax", ["top_key.block_tops"], "top_key.top_block", axis=-1, keepdims=1),  # the first holding it
        node("ReduceMax", ["top_key.block_tops", "top_key.last"], "top_key.top_score", keepdims=1),
        node("GatherND", ["top_key.blocks", "top_key.top_block"], "top_key.top_block_scores", batch_dims=1),
        node("ArgMax", ["top_key.top_block_scores"], "top_key.within", axis=-1, keepdims=1),
        node("Mul", ["top_key.top_block", "top_key.width"], "top_key.block_start"),
        node("Add", ["top_key.block_start", "top_key.within"], "top_key.top_key"),
        node("Concat", ["top_key.rows_shape", "top_key.one"], "top_key.kept_shape", axis=0),
        node("Reshape", ["top_key.top_key", "top_key.kept_shape"], key),
        node("Reshape", ["top_key.top_score", "top_key.kept_shape"], score),
    ], "summaries.top_key_by_blocks", [], out)  # fmt: skip
    by_keys = make.make_graph([
        node("ArgMax", [scores], key, axis=-1, keepdims=1),
        node("GatherElements", [scores, key], score, axis=-1),
    ], "summaries.top_key_by_keys", [], out)  # fmt: skip
    return [
        constant("top_key.zero", [0]),
        constant("top_key.one", [1]),
        constant("top_key.last", [-1]),
        constant("top_key.keys_axis", [3]),
        constant("top_key.two", [2]),
        constant("top_key.widths", list(BLOCK_WIDTHS)),
        node("Shape", [scores], "top_key.scores_shape"),
        node("Slice", ["top_key.scores_shape", "top_key.zero", "top_key.keys_axis"], "top_key.rows_shape"),
        node("Gather", ["top_key.scores_shape", "top_key.keys_axis"], "top_key.keys", axis=0),
        node("Mod", ["top_key.keys", "top_key.widths"], "top_key.keys_past_blocks"),
        node("Equal", ["top_key.keys_past_blocks", "top_key.zero"], "top_key.divides"),
        node("Mul", ["top_key.widths", "top_key.two"], "top_key.two_blocks"),
        node("LessOrEqual", ["top_key.two_blocks", "top_key.keys"], "top_key.two_or_more"),
        node("And", ["top_key.divides", "top_key.two_or_more"], "top_key.fits"),
        node("Cast", ["top_key.fits"], "top_key.fits_as_number", to=TensorProto.INT32),
        node("ArgMax", ["top_key.fits_as_number"], "top_key.first_fit", axis=0, keepdims=1),
        node("Gather", ["top_key.widths", "top_key.first_fit"], "top_key.width", axis=0),
        node("ReduceMax", ["top_key.fits_as_number"], "top_key.any_fits", keepdims=1),
        node("Cast", ["top_key.any_fits"], "top_key.in_blocks", to=TensorProto.BOOL),
        make.make_node("If", ["top_key.in_blocks"], [key, score], name="summaries.top_key_search",
                       then_branch=by_blocks, else_branch=by_keys),
    ]  # fmt: skip


# Cases the summaries graph is validated on: (batch, q_len, kv_len, mask, input scale). A padded batch with a row
# that may attend no key, a causal one, cross-attention, and inputs ten times larger (scores in the hundreds).
CASES = ((2, 12, 12, "padded", 1.0), (1, 64, 64, "causal", 1.0), (2, 7, 33, "none", 1.0), (1, 32, 32, "none", 10.0))
# Within this of the float64 summaries: the entropy in nats, the sink and the largest weight as the weights are
# (the export's float32 tolerance); the largest weight's key wherever the row's two largest weights differ by more.
# Or, as the export's validation judges input scales, no further than EAGER_ERROR_FACTOR times eager float32's own
# summaries are (scores in the hundreds put float32's weights past 1e-5).
ENTROPY_WITHIN = 1e-4
WEIGHTS_WITHIN = 1e-5


def exact_summaries(weights: np.ndarray) -> dict[str, np.ndarray]:
    """The summaries of float64 weights [B, h, Lq, Lk], as the graph states them."""
    logs = np.log(np.where(weights > 0, weights, 1.0))
    largest = weights.max(axis=-1)
    return {ATTN_ENTROPY: -(weights * logs).sum(axis=-1), ATTN_SINK: weights[..., 0], ATTN_MAX: largest,
            ATTN_MAX_INDEX: np.where(largest > 0, weights.argmax(axis=-1), -1)}  # fmt: skip


def _error(got: dict, want: dict, names: tuple[str, ...]) -> float:
    return float(max(np.abs(got[name] - want[name]).max() for name in names))


def validate_summaries(module, graph: bytes, seed: int | None, report) -> list[dict]:
    """The summaries graph's answers on CASES against the summaries of the eager module's float64 weights, and its
    output against the eager output: one record per case, its status pass or fail."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(graph, providers=["CPUExecutionProvider"])
    names = [output.name for output in session.get_outputs()]
    rng = np.random.default_rng(seed)
    exact = module.double().eval()
    results = []
    try:
        for batch, q_len, kv_len, kind, scale in CASES:
            query = (rng.standard_normal((batch, q_len, module.d_model)) * scale).astype(np.float32)
            key = query if q_len == kv_len else (rng.standard_normal((batch, kv_len, module.d_model)) * scale)
            key = key.astype(np.float32)
            mask = np.ones((batch, 1, q_len, kv_len), bool)
            if kind == "causal":
                mask[:] = np.tril(np.ones((q_len, kv_len), bool))
            elif kind == "padded":
                mask[-1, :, :, kv_len // 2 :] = False
                mask[-1, :, 1] = False  # a row that may attend no key
            got = dict(zip(names, session.run(None, {"query": query, "key": key, "value": key, "mask": mask}),
                           strict=True))  # fmt: skip
            with torch.no_grad():
                tensors = (torch.from_numpy(a.astype(np.float64)) for a in (query, key, key))
                want_output, want_weights = (t.numpy() for t in exact(*tensors, mask=torch.from_numpy(mask)))
                exact.float()
                eager = exact(*(torch.from_numpy(a) for a in (query, key, key)), mask=torch.from_numpy(mask))[1]
                exact.double()
            want, float32 = exact_summaries(want_weights), exact_summaries(eager.numpy().astype(np.float64))
            ordered = np.sort(want_weights, axis=-1)
            clear = ordered[..., -1] - (ordered[..., -2] if kv_len > 1 else 0.0) > WEIGHTS_WITHIN
            record = {
                "case": f"[{batch},{q_len},{kv_len}] {kind} x{scale:g}",
                "entropy_error": _error(got, want, (ATTN_ENTROPY,)),
                "weights_error": _error(got, want, (ATTN_SINK, ATTN_MAX)),
                "keys_differing": int(((got[ATTN_MAX_INDEX] != want[ATTN_MAX_INDEX]) & clear).sum()),
                "output_error": float(np.abs(got[OUTPUT] - want_output).max() / max(np.abs(want_output).max(), 1.0)),
            }
            allowed = {
                "entropy_error": max(ENTROPY_WITHIN, EAGER_ERROR_FACTOR * _error(float32, want, (ATTN_ENTROPY,))),
                "weights_error": max(WEIGHTS_WITHIN, EAGER_ERROR_FACTOR * _error(float32, want, (ATTN_SINK, ATTN_MAX))),
            }
            held = (all(record[name] <= limit for name, limit in allowed.items()) and record["keys_differing"] == 0
                    and record["output_error"] <= WEIGHTS_WITHIN * max(1.0, scale**2))  # fmt: skip
            record["status"] = "pass" if held else "fail"
            results.append(record)
    finally:
        module.float()
    failed = [r["case"] for r in results if r["status"] != "pass"]
    report(
        f"summaries graph: {len(results)} cases against float64, entropy within "
        f"{max(r['entropy_error'] for r in results):.1e} nats, sink and largest weight within "
        f"{max(r['weights_error'] for r in results):.1e}: " + (f"FAILED {', '.join(failed)}" if failed else "pass")
    )
    return results
