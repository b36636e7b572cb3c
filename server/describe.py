"""What the server says about itself and its served versions, as plain dicts in the protocol's JSON shape.

REST writes them as they are; gRPC parses them into the messages of the same names (the field names
are the protocol's, so one statement serves both transports).
"""

from __future__ import annotations

import copy
import dataclasses

from google.protobuf import json_format

import mhaserve
from mhaserve.contract.signature import COMPUTES_IN, input_specs, output_specs

from .config import setting_text
from .model_config import policy_message
from .registry import ServedModel
from .shared_memory import RegionStatus
from .statistics import Duration

PLATFORM = "onnxruntime_onnx"
EXTENSIONS = ["model_configuration", "model_repository", "statistics", "binary_tensor_data", "trace", "logging"]
# The gRPC call each extension answers by (binary_tensor_data is HTTP's alone)
EXTENSION_RPCS = {"model_configuration": "ModelConfig", "model_repository": "RepositoryIndex",
                  "statistics": "ModelStatistics", "trace": "TraceSetting", "logging": "LogSettings"}  # fmt: skip
CONFIG_DATA_TYPES = {"FP16": "TYPE_FP16", "FP32": "TYPE_FP32", "BOOL": "TYPE_BOOL", "INT64": "TYPE_INT64"}


def server_metadata(shared_memory: bool = False, rpcs: frozenset[str] | None = None) -> dict:
    """``shared_memory``: client shared memory is allowed (only then is the extension listed); ``rpcs``: the gRPC
    calls answered where not every one is (a Ray deployment's proxy): the extensions they do not answer are not
    listed."""
    extensions = [*EXTENSIONS, "system_shared_memory"] if shared_memory else EXTENSIONS
    if rpcs is not None:
        extensions = [name for name in extensions if EXTENSION_RPCS.get(name) in rpcs]
    return {"name": "mhaserve", "version": mhaserve.__version__, "extensions": extensions}


def shared_memory_status(regions: list[RegionStatus]) -> list[dict]:
    """The registered system shared-memory regions, as the extension's status lists them."""
    return [{"name": r.name, "key": r.key, "offset": r.offset, "byte_size": r.byte_size} for r in regions]


def model_metadata(served: ServedModel, ready_versions: list[int]) -> dict:
    s = served.signature

    def tensors(specs):
        return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in specs]

    metadata = {
        "name": s.name,
        "versions": [str(v) for v in ready_versions],
        "platform": PLATFORM,
        "inputs": tensors(input_specs(s.d_model)),
        "outputs": tensors(output_specs(s.d_model, s.num_heads, s.precision)),
    }
    parity = served.batched.parity
    if parity is not None:  # how far its answers are proven, where it checks them (live parity)
        summary = parity.summary()
        metadata["parameters"] = {f"parity_{name}": summary[name] for name in ("share", "checked", "breached")}
    return metadata


def model_config(served: ServedModel) -> dict:
    """Triton's ModelConfig: max_batch_size 0 because the batch dim is part of every shape, as in the
    metadata (no implicit batching). Its parameters also say how this version is served (the provider, and the
    settings named as ``mhaserve serve``'s flags), so that a load test can record what it measured."""
    s = served.signature
    config = {
        "name": s.name,
        "platform": PLATFORM,
        "backend": "onnxruntime",
        "max_batch_size": 0,
        "input": [
            {"name": t.name, "data_type": CONFIG_DATA_TYPES[t.datatype], "dims": list(t.shape), "optional": t.optional}
            for t in input_specs(s.d_model)
        ],
        "output": [
            {"name": t.name, "data_type": CONFIG_DATA_TYPES[t.datatype], "dims": list(t.shape)}
            for t in output_specs(s.d_model, s.num_heads, s.precision)
        ],
        "default_model_filename": "model.onnx",
        # What a client sizing buffers for the weights needs (a shared-memory window): the heads dim is -1 above.
        # and what the graph computes in (an int8 model's tensors are FP32 like a float32 model's).
        "parameters": {
            "d_model": {"string_value": str(s.d_model)},
            "num_heads": {"string_value": str(s.num_heads)},
            "precision": {"string_value": s.precision},
            "computes_in": {"string_value": COMPUTES_IN[s.precision]},
            **{name: {"string_value": value} for name, value in serving_settings(served).items()},
        },
    }
    settings = served.settings
    config["version_policy"] = json_format.MessageToDict(policy_message(settings.version_policy),
                                                         preserving_proto_field_name=True)  # fmt: skip
    if settings.dynamic_batching:
        config["dynamic_batching"] = {
            "max_queue_delay_microseconds": settings.max_queue_delay_us,
            "default_queue_policy": {
                "timeout_action": "REJECT",
                "default_timeout_microseconds": settings.queue_timeout_us,
                "allow_timeout_override": settings.allow_timeout_override,
                "max_queue_size": settings.max_queue_size,
            },
            "priority_levels": settings.priority_levels,
            "default_priority_level": settings.default_priority_level,
            "priority_queue_policy": {
                str(level): {"timeout_action": "REJECT", **dataclasses.asdict(policy)}
                for level, policy in served.batched.queue.levels.items()
            },
        }
    return config


def serving_settings(served: ServedModel) -> dict[str, str]:
    """How this version runs: its runtimes' provider and the settings that shape its latency, as text."""
    shown = {
        **served.batched.describe(),
        "max_q_len": served.limits.max_q_len,
        "max_kv_len": served.limits.max_kv_len,
        **({"max_sequence_length": served.settings.max_sequence_length} if served.signature.serves_sequences else {}),
        # where those came from: the model's config.pbtxt over the server's flags, or the flags alone
        "model_config": served.settings.source or "none",
    }
    return {name: setting_text(value) for name, value in shown.items()}


def model_statistics(served: ServedModel) -> dict:
    """Triton's statistics extension for one version (durations in nanoseconds)."""
    s = served.stats

    def duration(d: Duration) -> dict:
        return {"count": d.count, "ns": d.ns}

    parity = served.batched.parity
    with s.lock:
        return {
            **({"parity": parity.summary()} if parity is not None else {}),
            "name": served.signature.name,
            "version": served.signature.version,
            "last_inference": s.last_inference_ms,
            "inference_count": s.inference_count,
            "execution_count": s.execution_count,
            "inference_stats": {
                name: duration(getattr(s, name))
                for name in ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": duration(d.compute_input),
                    "compute_infer": duration(d.compute_infer),
                    "compute_output": duration(d.compute_output),
                }
                for size, d in sorted(s.batch_sizes.items())
            ],
        }


def merged_statistics(own: list[dict], others: list[list[dict]]) -> list[dict]:
    """``own`` model_stats with the same versions' figures of other processes added (the workers of one server):
    counts and durations summed, batch sizes merged, the last inference the latest."""
    merged = copy.deepcopy(own)
    by_version = {(stats["name"], stats["version"]): stats for stats in merged}
    for process in others:
        for theirs in process:
            ours = by_version.get((theirs["name"], theirs["version"]))
            if ours is None:  # a version this process does not serve (loading, say): not asked about here
                continue
            ours["last_inference"] = max(ours["last_inference"], theirs["last_inference"])
            for count in ("inference_count", "execution_count"):
                ours[count] += theirs[count]
            for name, duration in theirs["inference_stats"].items():
                _add(ours["inference_stats"][name], duration)
            batches = {batch["batch_size"]: batch for batch in ours["batch_stats"]}
            for batch in theirs["batch_stats"]:
                if batch["batch_size"] not in batches:
                    batches[batch["batch_size"]] = copy.deepcopy(batch)
                    continue
                for part in ("compute_input", "compute_infer", "compute_output"):
                    _add(batches[batch["batch_size"]][part], batch[part])
            ours["batch_stats"] = [batches[size] for size in sorted(batches)]
            if "parity" in theirs and "parity" in ours:
                _add_parity(ours["parity"], theirs["parity"])
            elif "parity" in theirs:
                ours["parity"] = copy.deepcopy(theirs["parity"])
    return merged


def _add_parity(total: dict, more: dict) -> None:
    for outcome in ("checked", "held", "breached", "dropped", "pending"):
        total[outcome] += more[outcome]
    for output, error in more["worst_error"].items():
        total["worst_error"][output] = max(total["worst_error"].get(output, 0.0), error)


def _add(total: dict, more: dict) -> None:
    total["count"] += more["count"]
    total["ns"] += more["ns"]


def repository_index(rows: list[tuple[str, str, str, str]]) -> list[dict]:
    return [{"name": n, "version": v, "state": state, "reason": reason} for n, v, state, reason in rows]
