"""Export the MHA module to an ONNX graph with dynamic batch, sequence and mask axes.

Why the TorchScript exporter (``dynamo=False``) and not torch.export, measured with torch 2.13:
the dynamo exporter cannot express a mask dim that is "1 or B"; it merges the mask's batch dim
with the query's ``batch`` symbol and then takes the batch size from the mask, so a [1, 1, Lq, Lk]
mask against a batch of 3 fails in ONNX Runtime. The TorchScript graph broadcasts the mask with
ONNX semantics at run time, so [B|1, 1, Lq|1, Lk] masks all work, and it exports in 0.3 s, not 8 s.

The example inputs matter as much as the exporter (tests/test_export.py guards each one):
- no dynamic dim is 1 in the example, or it can be baked into the graph as a constant;
- query and key have different lengths and are different tensors, or Lk is tied to Lq and the
  graph never reads ``key``;
- the mask's batch and query-length dims get names of their own, so a graph never takes the
  batch size from the mask and accepts both [B, 1, 1, Lk] and [B, 1, Lq, Lk].
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

import onnx
import torch
from torch import nn

from mhaserve.model import MultiHeadAttention

DEFAULT_OPSET = 17
INPUT_NAMES = ("query", "key", "value", "mask")
OUTPUT_NAMES = ("output", "attn_weights")
DYNAMIC_AXES = {
    "query": {0: "batch", 1: "q_len"},
    "key": {0: "batch", 1: "kv_len"},
    "value": {0: "batch", 1: "kv_len"},
    "mask": {0: "mask_batch", 2: "mask_q_len", 3: "kv_len"},
    "output": {0: "batch", 1: "q_len"},
    "attn_weights": {0: "batch", 2: "q_len", 3: "kv_len"},
}
# Distinct and never 1: see the module docstring.
EXAMPLE_BATCH, EXAMPLE_Q_LEN, EXAMPLE_KV_LEN = 2, 5, 7
# Protobuf cannot hold a model over 2 GiB; beyond this, weights go to an external data file.
SINGLE_FILE_LIMIT_BYTES = 1_800_000_000


class _OnnxSignature(nn.Module):
    """The served signature: every input explicit, the mask as [B|1, 1, Lq|1, Lk] bool."""

    def __init__(self, mha: MultiHeadAttention):
        super().__init__()
        self.mha = mha

    def forward(self, query, key, value, mask):
        return self.mha(query, key, value, mask)


def example_inputs(d_model: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(EXAMPLE_BATCH, EXAMPLE_Q_LEN, d_model, generator=generator)
    key = torch.randn(EXAMPLE_BATCH, EXAMPLE_KV_LEN, d_model, generator=generator)
    value = torch.randn(EXAMPLE_BATCH, EXAMPLE_KV_LEN, d_model, generator=generator)
    mask = torch.ones(EXAMPLE_BATCH, 1, EXAMPLE_Q_LEN, EXAMPLE_KV_LEN, dtype=torch.bool)
    return query, key, value, mask


def export_onnx(module: MultiHeadAttention, opset: int = DEFAULT_OPSET) -> onnx.ModelProto:
    """Trace ``module`` (in eval mode) to an ONNX model with the served signature and dynamic axes."""
    module = module.eval()
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(), torch.no_grad():
        # The TorchScript exporter is deprecated in favour of dynamo; we choose it on purpose (above).
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        torch.onnx.export(
            _OnnxSignature(module),
            example_inputs(module.d_model),
            # A file, not a buffer: past 2 GiB the exporter must write external data beside it.
            Path(tmp) / "model.onnx",
            dynamo=False,
            opset_version=opset,
            input_names=list(INPUT_NAMES),
            output_names=list(OUTPUT_NAMES),
            dynamic_axes=DYNAMIC_AXES,
            do_constant_folding=True,
        )
        return onnx.load(Path(tmp) / "model.onnx", load_external_data=True)


def check_onnx(model: onnx.ModelProto) -> None:
    """onnx.checker (full check) and strict shape inference; raises on any problem."""
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)


def save_onnx(model: onnx.ModelProto, path: Path) -> None:
    """One file, unless the weights are too large for a single protobuf."""
    weight_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    external = weight_bytes > SINGLE_FILE_LIMIT_BYTES
    onnx.save_model(
        model,
        str(path),
        save_as_external_data=external,
        all_tensors_to_one_file=True,
        location=f"{path.name}.data" if external else None,
    )
