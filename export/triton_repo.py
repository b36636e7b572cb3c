"""The same export as a Triton model repository, for Triton or KServe on Kubernetes with the same clients.

    REPO/NAME/config.pbtxt     platform onnxruntime_onnx, dynamic batching, dims from the model
    REPO/NAME/1/model.onnx     the validated graph, byte for byte

Triton batches along the first dim, so dims here leave it out (max_batch_size > 0): the graph's
``mask`` [mask_batch, 1, mask_q_len, kv_len] becomes dims [1, -1, -1], and Triton sends it with
the batch's size. The ONNX graph has no optional inputs: Triton clients send all four. Triton serves the
graph's outputs only: ``attn_weights_mean`` is mhaserve's, taken from the weights when asked for.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from google.protobuf import text_format

from mhaserve.contract.model_dir import MODEL_FILE, ModelDirError, read_manifest
from mhaserve.contract.signature import COMPUTES_IN, WEIGHTS_DATATYPES
from mhaserve.protos.generated import model_config_pb2 as mc

DEFAULT_MAX_BATCH_SIZE = 32


def triton_config(
    name: str, d_model: int, num_heads: int, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE, precision: str = "fp32"
):
    fp32, boolean = mc.TYPE_FP32, mc.TYPE_BOOL
    weights = mc.DataType.Value("TYPE_" + WEIGHTS_DATATYPES[precision])
    return mc.ModelConfig(
        name=name,
        platform="onnxruntime_onnx",
        backend="onnxruntime",
        max_batch_size=max_batch_size,
        input=[
            mc.ModelInput(name="query", data_type=fp32, dims=[-1, d_model]),
            mc.ModelInput(name="key", data_type=fp32, dims=[-1, d_model]),
            mc.ModelInput(name="value", data_type=fp32, dims=[-1, d_model]),
            mc.ModelInput(name="mask", data_type=boolean, dims=[1, -1, -1]),
        ],
        output=[
            mc.ModelOutput(name="output", data_type=fp32, dims=[-1, d_model]),
            mc.ModelOutput(name="attn_weights", data_type=weights, dims=[num_heads, -1, -1]),
        ],
        dynamic_batching=mc.ModelDynamicBatching(max_queue_delay_microseconds=0),
        parameters={
            "precision": mc.ModelParameter(string_value=precision),
            "computes_in": mc.ModelParameter(string_value=COMPUTES_IN[precision]),
        },
    )


def write_triton_repo(model_dir: str | Path, repo: str | Path, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> Path:
    """Write REPO/NAME/{config.pbtxt,1/model.onnx} from a valid model folder; returns REPO/NAME."""
    model_dir, repo = Path(model_dir), Path(repo)
    manifest = read_manifest(model_dir)
    if not manifest.get("valid"):
        raise ModelDirError(f"{model_dir}: not a valid export; no Triton repository written")
    config = manifest["config"]
    name = manifest.get("name", "mha")
    target = repo / name
    (target / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_dir / MODEL_FILE, target / "1" / "model.onnx")
    model_config = triton_config(
        name, config["d_model"], config["num_heads"], max_batch_size, manifest.get("precision", "fp32")
    )
    text = text_format.MessageToString(model_config)
    (target / "config.pbtxt").write_text(text)
    return target
