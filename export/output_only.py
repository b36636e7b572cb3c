"""The output-only graph: the served module without its attention-weights output, for requests that ask for
none of the weights.

Built from the module's four projections, not traced: what makes it faster is ONNX Runtime's fused CPU
attention (com.microsoft ``MultiHeadAttention``), which torch.export has no op for. That kernel runs
FlashAttention (tiled, never materializing the [Lq, Lk] scores) only when it gets no mask and no bias, so
the graph asks at run time whether the mask allows every key and takes that path then, and the fused
kernel with the mask as an additive bias otherwise. ONNX's own ``Attention`` op (opset 23) was measured
too: ONNX Runtime 1.31 runs it through the same unfused path as the traced graph, bit for bit
(BENCHMARKS.md, "Attention weights shaped per request"). Like every exported graph it is validated against the eager
module (validate.py), so a difference from the traced graph cannot pass unseen.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper
from onnx import helper as make

from mhaserve.contract import signature
from mhaserve.model import MultiHeadAttention

OPSET = 18
CONTRIB_DOMAIN = "com.microsoft"
PROJECTIONS = (("W_q", signature.QUERY), ("W_k", signature.KEY), ("W_v", signature.VALUE))


def _constant(name: str, values, dtype) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(values, dtype=dtype), name)


def _linear(module: MultiHeadAttention, name: str, source: str, target: str) -> tuple[list, list]:
    """x @ W.T + b, as the traced graph computes nn.Linear on [B, L, d]."""
    layer = getattr(module, name)
    weight = layer.weight.detach().to("cpu").float().numpy().T.copy()
    bias = layer.bias.detach().to("cpu").float().numpy()
    initializers = [_constant(f"{name}.weight_t", weight, np.float32), _constant(f"{name}.bias", bias, np.float32)]
    nodes = [
        make.make_node("MatMul", [source, f"{name}.weight_t"], [f"{name}.product"], name=f"{name}.matmul"),
        make.make_node("Add", [f"{name}.product", f"{name}.bias"], [target], name=f"{name}.add"),
    ]
    return initializers, nodes


def output_only_graph(module: MultiHeadAttention) -> onnx.ModelProto:
    """The module's served signature (query, key, value, mask) with ``output`` as its only output."""
    module = module.eval()
    d, heads = module.d_model, module.num_heads
    initializers = [
        _constant("one", 1.0, np.float32),
        # The mask as an additive bias: half float32's lowest, as model.mha.masked_softmax (finite on a row
        # with every key masked, which the last Mul zeroes).
        _constant("masked_bias", np.finfo(np.float32).min / 2, np.float32),
        _constant("last_axis", [-1], np.int64),
        _constant("head_axis", [1], np.int64),
        _constant("ones_2", [1, 1], np.int64),
        _constant("ones_1", [1], np.int64),
    ]
    nodes = []
    for name, source in PROJECTIONS:
        more, steps = _linear(module, name, source, f"{name}.out")
        initializers += more
        nodes += steps
    heads_in = ["W_q.out", "W_k.out", "W_v.out"]
    unmasked = make.make_graph(
        [make.make_node("MultiHeadAttention", heads_in, ["context_unmasked"], domain=CONTRIB_DOMAIN, num_heads=heads)],
        "every_key_allowed",
        [],
        [make.make_tensor_value_info("context_unmasked", TensorProto.FLOAT, None)],
    )
    masked = make.make_graph(
        [
            # The fused kernel takes a bias of [B|1, 1, Lq, Lk]: a mask broadcast over query rows is expanded.
            make.make_node("Shape", [signature.QUERY], ["query_length"], start=1, end=2),
            make.make_node("Concat", ["ones_2", "query_length", "ones_1"], ["bias_shape"], axis=0),
            make.make_node("Expand", ["bias", "bias_shape"], ["bias_rows"]),
            make.make_node(
                "MultiHeadAttention",
                [*heads_in, "", "", "bias_rows"],  # inputs 3 and 4 (packed bias, key padding) unused
                ["context_masked"],
                domain=CONTRIB_DOMAIN,
                num_heads=heads,
            ),
        ],
        "some_key_masked",
        [],
        [make.make_tensor_value_info("context_masked", TensorProto.FLOAT, None)],
    )
    nodes += [
        make.make_node("Cast", [signature.MASK], ["allowed"], to=TensorProto.FLOAT),
        make.make_node("Sub", ["one", "allowed"], ["blocked"]),
        make.make_node("Mul", ["blocked", "masked_bias"], ["bias"]),
        make.make_node("ReduceMin", ["allowed"], ["every_key_allowed_f"], keepdims=0),
        make.make_node("Cast", ["every_key_allowed_f"], ["every_key_allowed"], to=TensorProto.BOOL),
        make.make_node("If", ["every_key_allowed"], ["context"], then_branch=unmasked, else_branch=masked),
    ]
    more, steps = _linear(module, "W_o", "context", "projected")
    initializers += more
    nodes += steps
    nodes += [
        # Zero the output of a query row with every key masked, as the eager module does.
        make.make_node("ReduceMax", ["allowed", "last_axis"], ["row_attends"], keepdims=1),
        make.make_node("ReduceMax", ["row_attends", "head_axis"], ["rows_attending"], keepdims=0),
        make.make_node("Mul", ["projected", "rows_attending"], [signature.OUTPUT]),
    ]
    inputs = [
        make.make_tensor_value_info(signature.QUERY, TensorProto.FLOAT, ["batch", "q_len", d]),
        make.make_tensor_value_info(signature.KEY, TensorProto.FLOAT, ["batch", "kv_len", d]),
        make.make_tensor_value_info(signature.VALUE, TensorProto.FLOAT, ["batch", "kv_len", d]),
        make.make_tensor_value_info(signature.MASK, TensorProto.BOOL, ["mask_batch", 1, "mask_q_len", "kv_len"]),
    ]
    outputs = [make.make_tensor_value_info(signature.OUTPUT, TensorProto.FLOAT, ["batch", "q_len", d])]
    graph = make.make_graph(nodes, "mha_output_only", inputs, outputs, initializers)
    opsets = [make.make_opsetid("", OPSET), make.make_opsetid(CONTRIB_DOMAIN, 1)]
    return make.make_model(graph, opset_imports=opsets, ir_version=10)
