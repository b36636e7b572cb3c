"""Where the output-only graph's time goes on CUDA: the served graph against variants of it, host to host.

    PYTHONPATH=/tmp/mhaserve-gpu/site python3 benchmarks/gpu/fused_variants.py [--repeats 30] [--device cpu]

Each variant is built from the same seeded module, run as the server runs an output-only request on CUDA
(``server.session.run_bound``: each distinct input copied up once, the output written into a host array),
checked against eager float32, and timed (median of ``--repeats`` after warm-up, once in each of ``--rounds``
rounds, the variants in a fresh order each round; the ratio to eager is taken within a round), beside eager
and the bytes' crossing alone (the query up and the output down by torch):
- served: ``export.output_only.output_only_graph``, the graph the server runs (mask tested on the device; the
  If's condition is copied to the host mid-run);
- host cond: the same graph with the If's condition fed from the host (the server would test the mask);
- mask in branch: the condition from the host, and all the mask costs (its bias, the masked kernel, the zeroing
  of rows with no key allowed) inside the masked branch, W_o in both: a run with every key allowed computes what
  ``no mask`` does, in the served graph's signature plus the condition;
- no mask: projections, the fused MultiHeadAttention without a mask, W_o: what an all-keys request needs;
- bias in MHA: as ``no mask`` with the q/k/v biases given to MultiHeadAttention instead of three Adds;
- one matmul: self-attention only, the three projections as one [d, 3d] MatMul, split, biases in MHA;
- packed qkv: self-attention only, one MatMul into MultiHeadAttention's packed [B, L, N, 3, H] form;
- on CUDA, pinned: the served graph (or no mask) with its output written into pinned host memory, and with the query
  copied into pinned memory first (that copy timed), as a server keeping pinned buffers would run.
Not a test: it prints numbers for BENCHMARKS.md. ``--device cpu`` is the dry run.
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import sys

import numpy as np
import onnx
import onnxruntime as ort
import torch
from bench_cuda import median_ms  # beside this script
from onnx import TensorProto, numpy_helper
from onnx import helper as make

from mhaserve.contract import signature
from mhaserve.export.output_only import CONTRIB_DOMAIN, OPSET, output_only_graph
from mhaserve.model.weights import seeded_module
from mhaserve.server.session import run_bound

SHAPES = [(8, 512, 512, 8), (32, 128, 768, 12), (1, 128, 512, 8)]


def _weights(module, name):
    layer = getattr(module, name)
    return layer.weight.detach().float().numpy().T.copy(), layer.bias.detach().float().numpy()


def _const(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def _model(nodes, inputs, initializers, d) -> onnx.ModelProto:
    ins = [make.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", f"{n}_len", d]) for n in inputs]
    out = [make.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "query_len", d])]
    graph = make.make_graph(nodes, "variant", ins, out, initializers)
    opsets = [make.make_opsetid("", OPSET), make.make_opsetid(CONTRIB_DOMAIN, 1)]
    return make.make_model(graph, opset_imports=opsets, ir_version=10)


def _w_o(module, source):
    w, b = _weights(module, "W_o")
    nodes = [make.make_node("MatMul", [source, "W_o.w"], ["o.p"]), make.make_node("Add", ["o.p", "W_o.b"], ["output"])]
    return nodes, [_const("W_o.w", w), _const("W_o.b", b)]


def no_mask(module, bias_in_mha: bool) -> onnx.ModelProto:
    heads, d = module.num_heads, module.d_model
    nodes, inits = [], []
    for name, source in (("W_q", "query"), ("W_k", "key"), ("W_v", "value")):
        w, b = _weights(module, name)
        inits += [_const(f"{name}.w", w)] + ([] if bias_in_mha else [_const(f"{name}.b", b)])
        target = f"{name}.out" if not bias_in_mha else f"{name}.p"
        nodes.append(make.make_node("MatMul", [source, f"{name}.w"], [f"{name}.p"]))
        if not bias_in_mha:
            nodes.append(make.make_node("Add", [f"{name}.p", f"{name}.b"], [target]))
    mha_in = ["W_q.out", "W_k.out", "W_v.out"] if not bias_in_mha else ["W_q.p", "W_k.p", "W_v.p", "qkv.b"]
    if bias_in_mha:
        inits.append(_const("qkv.b", np.concatenate([_weights(module, n)[1] for n in ("W_q", "W_k", "W_v")])))
    nodes.append(make.make_node("MultiHeadAttention", mha_in, ["context"], domain=CONTRIB_DOMAIN, num_heads=heads))
    more, o_inits = _w_o(module, "context")
    return _model(nodes + more, ("query", "key", "value"), inits + o_inits, d)


def one_matmul(module, packed: bool) -> onnx.ModelProto:
    heads, d = module.num_heads, module.d_model
    parts = [_weights(module, n) for n in ("W_q", "W_k", "W_v")]
    weight, bias = np.concatenate([w for w, _ in parts], axis=1), np.concatenate([b for _, b in parts])
    if packed:  # MultiHeadAttention's packed form is [B, L, N, 3, H]: columns reordered to head, then q/k/v
        order = np.arange(3 * d).reshape(3, heads, d // heads).transpose(1, 0, 2).reshape(-1)
        weight, bias = weight[:, order], bias[order]
    inits = [_const("qkv.w", weight), _const("qkv.b", bias)]
    nodes = [make.make_node("MatMul", ["query", "qkv.w"], ["qkv"])]
    if packed:
        inits.append(_const("packed_shape", np.array([0, 0, heads, 3, d // heads], np.int64)))
        nodes += [
            make.make_node("Add", ["qkv", "qkv.b"], ["qkv_b"]),
            make.make_node("Reshape", ["qkv_b", "packed_shape"], ["packed"]),
            make.make_node("MultiHeadAttention", ["packed"], ["context"], domain=CONTRIB_DOMAIN, num_heads=heads),
        ]
    else:
        nodes += [
            make.make_node("Split", ["qkv"], ["q", "k", "v"], axis=-1, num_outputs=3),
            make.make_node(
                "MultiHeadAttention", ["q", "k", "v", "qkv.b"], ["context"], domain=CONTRIB_DOMAIN, num_heads=heads
            ),  # fmt: skip
        ]
    more, o_inits = _w_o(module, "context")
    return _model(nodes + more, ("query",), inits + o_inits, d)


def host_cond(module) -> onnx.ModelProto:
    """The served graph with the If's condition a graph input (bool scalar, bound in host memory)."""
    model = output_only_graph(module)
    graph = model.graph
    kept = [n for n in graph.node if n.output[0] not in ("every_key_allowed_f", "every_key_allowed")]
    del graph.node[:]
    graph.node.extend(kept)
    graph.input.append(make.make_tensor_value_info("every_key_allowed", TensorProto.BOOL, []))
    return model


def mask_in_branch(module) -> onnx.ModelProto:
    """``host_cond``'s graph rearranged: the mask's whole cost (its bias, the masked kernel, the zeroing of rows
    with no key allowed) moved into the masked branch, W_o into both, so that the unmasked branch computes what
    ``no mask`` does. Built from the served graph's own nodes, so it follows any change to them."""
    model = host_cond(module)
    graph = model.graph
    nodes = list(graph.node)
    at = next(i for i, n in enumerate(nodes) if n.op_type == "If")
    branches = {a.name: a.g for a in nodes[at].attribute}
    mask_work = [n for n in nodes[:at] if n.output[0] in ("allowed", "blocked", "bias")]
    after = nodes[at + 1 :]  # W_o on "context", then the zeroing into "output"
    w_o = [n for n in after if n.name.startswith("W_o.")]

    def renamed(node, names: dict) -> onnx.NodeProto:
        node = copy.deepcopy(node)
        node.input[:] = [names.get(name, name) for name in node.input]
        node.output[:] = [names.get(name, name) for name in node.output]
        node.name = ""
        return node

    def branch(name: str, before: list, context: str, last: list, out: str) -> onnx.GraphProto:
        names = {"context": context, signature.OUTPUT: out}
        names |= {n.output[0]: f"{context}.{n.output[0]}" for n in w_o}  # each branch's W_o its own names
        body = [*before, *branches[name].node, *(renamed(n, names) for n in w_o + last)]
        if not last:  # the unmasked branch answers W_o's output itself
            body[-1].output[0] = out
        return make.make_graph(body, name, [], [make.make_tensor_value_info(out, TensorProto.FLOAT, None)])

    zeroing = [n for n in after if n not in w_o]
    then_branch = branch("then_branch", [], "context_unmasked", [], "unmasked.output")
    else_branch = branch("else_branch", mask_work, "context_masked", zeroing, "masked.output")
    if_node = make.make_node(
        "If", ["every_key_allowed"], [signature.OUTPUT], then_branch=then_branch, else_branch=else_branch
    )
    del graph.node[:]
    graph.node.extend([n for n in nodes[:at] if n not in mask_work] + [if_node])
    return model


def masked_case_differs(module, providers) -> float:
    """The largest difference between ``mask_in_branch`` and the served graph on masked inputs (some keys
    blocked, one query row with none allowed), where the variants above are timed with every key allowed."""
    rng = np.random.default_rng(1)
    q, kv = (rng.standard_normal((2, n, module.d_model), dtype=np.float32) for n in (5, 7))
    mask = rng.random((2, 1, 5, 7)) < 0.6
    mask[0, 0, 2, :] = False
    feed = {"query": q, "key": kv, "value": kv, "mask": mask}
    answers = []
    for build, extra in ((output_only_graph, {}), (mask_in_branch, {"every_key_allowed": np.array(False)})):
        session = ort.InferenceSession(build(module).SerializeToString(), providers=providers)
        answers.append(session.run(["output"], {**feed, **extra})[0])
    return float(np.abs(answers[0] - answers[1]).max())


def bound_run(session, feed: dict, x: np.ndarray, out: np.ndarray, device: str, staged=None, on_host=()) -> list:
    """One output-only run as ``run_bound`` makes it (the query copied to the device once, the output written into
    host memory: ``out``), but with ``staged``, the query first copied there (pinned memory, as a server receiving
    its bytes would have to), and the inputs named in ``on_host`` bound in host memory. On CUDA, copies between
    pinned memory and the device need no staging; in the CPU's dry run the buffers are plain memory."""
    binding = session.io_binding()
    if staged is not None:
        np.copyto(staged, x)
    on_device = ort.OrtValue.ortvalue_from_numpy(x if staged is None else staged, device, 0)
    for key, array in feed.items():
        if key in on_host:
            binding.bind_cpu_input(key, array)
        else:
            value = on_device if array is x else ort.OrtValue.ortvalue_from_numpy(array, device, 0)
            binding.bind_ortvalue_input(key, value)
    binding.bind_output("output", "cpu", 0, np.float32, out.shape, out.ctypes.data)
    session.run_with_iobinding(binding)
    return [out]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5, help="each variant timed once a round, in a fresh order")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("fused_variants: torch sees no GPU here; --device cpu is the dry run", file=sys.stderr)
        return 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    providers = (
        [("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"] if cuda else ["CPUExecutionProvider"]
    )
    torch.backends.cuda.matmul.allow_tf32 = False
    print(
        f"{torch.cuda.get_device_name() if cuda else 'cpu'}; onnxruntime {ort.__version__}; torch {torch.__version__}"
    )
    for batch, length, d, heads in SHAPES:
        module = seeded_module(d, heads).eval()
        x = np.random.default_rng(0).standard_normal((batch, length, d), dtype=np.float32)
        mask = np.ones((1, 1, 1, length), bool)
        with torch.inference_mode():
            want = module(torch.from_numpy(x))[0].numpy()
        on = copy.deepcopy(module).to(args.device)

        @torch.inference_mode()
        def eager(on=on, x=x):
            return on(torch.from_numpy(x).to(args.device))[0].cpu()

        def crossing(x=x):
            return torch.from_numpy(x).to(args.device).cpu()

        shape = f"[{batch},{length},{d}/{heads}]"
        print(f"{shape} mask in branch against the served graph, masked: max|diff| "
              f"{masked_case_differs(module, providers):.1e}", flush=True)  # fmt: skip
        calls = {"eager": (eager, 0.0), "crossing": (crossing, 0.0)}

        variants = {
            "served": (output_only_graph, {"query": x, "key": x, "value": x, "mask": mask}),
            "host cond": (
                host_cond,
                {"query": x, "key": x, "value": x, "mask": mask, "every_key_allowed": np.array(True)},
            ),
            "mask in branch": (
                mask_in_branch,
                {"query": x, "key": x, "value": x, "mask": mask, "every_key_allowed": np.array(True)},
            ),
            "no mask": (lambda m: no_mask(m, False), {"query": x, "key": x, "value": x}),
            "bias in mha": (lambda m: no_mask(m, True), {"query": x, "key": x, "value": x}),
            "one matmul": (lambda m: one_matmul(m, False), {"query": x}),
            "packed qkv": (lambda m: one_matmul(m, True), {"query": x}),
            # pinned host memory on CUDA; plain memory in the CPU's dry run
            "served, pinned out": (output_only_graph, {"query": x, "key": x, "value": x, "mask": mask}),
            "served, pinned in+out": (output_only_graph, {"query": x, "key": x, "value": x, "mask": mask}),
            "no mask, pinned out": (lambda m: no_mask(m, False), {"query": x, "key": x, "value": x}),
        }
        pinned = [torch.empty(x.shape, dtype=torch.float32, pin_memory=cuda) for _ in range(2)]
        for name, (build, feed) in variants.items():
            try:
                session = ort.InferenceSession(build(module).SerializeToString(), providers=providers)
                device = "cuda" if cuda else "cpu"
                if name in ("host cond", "mask in branch"):  # the condition stays in host memory, where If reads it

                    def call(session=session, feed=feed, x=x, device=device):
                        out = np.empty(x.shape, np.float32)
                        return bound_run(session, feed, x, out, device, on_host=("every_key_allowed",))
                elif "pinned" in name:
                    staged, out = (pinned[0].numpy() if "pinned in" in name else None), pinned[1].numpy()

                    def call(session=session, feed=feed, x=x, device=device, staged=staged, out=out):
                        return bound_run(session, feed, x, out, device, staged)
                else:  # the server's own run

                    def call(session=session, feed=feed, device=device, x=x):
                        return run_bound(session, ["output"], feed, {"output": x.shape}, device)

                calls[name] = (call, float(np.abs(call()[0] - want).max()))
            except Exception as error:  # one variant the provider refuses must not stop the others
                print(f"{shape} {name}: {type(error).__name__}: {str(error)[:200]}", flush=True)
        # Rounds, the variants in a fresh order each, so that a slow spell of the host falls on all of them.
        times = {name: [] for name in calls}
        order = list(calls)
        for round_ in range(args.rounds):
            random.Random(round_).shuffle(order)
            for name in order:
                times[name].append(median_ms(calls[name][0], args.repeats, sync, warmup=5))
        for name, (_, diff) in calls.items():
            ratios = [e / t for e, t in zip(times["eager"], times[name], strict=True)]
            print(
                f"{shape:>16} {name:>22} {statistics.median(times[name]):8.3f} ms  eager/this "
                f"{statistics.median(ratios):5.2f} ({min(ratios):.2f}-{max(ratios):.2f})  max|diff| {diff:.1e}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
