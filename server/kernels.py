"""Small ONNX graphs that ONNX Runtime runs where numpy is slow or cannot reach: for the weights' shaping, TopK
(the k largest weights of each row, ties by the lower position, as ONNX's TopK states) and a cast to float16 (numpy
converts element by element; BENCHMARKS.md, "Attention weights shaped per request", has the figures); and, for a
sequence's cache kept in a GPU's memory, its new rows appended there.

The serving path has no ``onnx`` package, so the graphs are kept here serialised; ``python -m
mhaserve.server.kernels`` builds them again with onnx and prints them, and a test checks they match.
"""

from __future__ import annotations

import base64
import functools

import numpy as np
import onnxruntime as ort

TOP_K_GRAPH = (
    "CAoSCG1oYXNlcnZlOqQBClgKB3dlaWdodHMKAWsSBnZhbHVlcxIHaW5kaWNlcyIEVG9wSyoUCgRheGlzGP///////////wGgAQIqDgoHbGFy"
    "Z2VzdBgBoAECKg0KBnNvcnRlZBgBoAECEgV0b3Bfa1oPCgd3ZWlnaHRzEgQKAggBWg8KAWsSCgoICAcSBAoCCAFiDgoGdmFsdWVzEgQKAggB"
    "Yg8KB2luZGljZXMSBAoCCAdCBAoAEBI="
)
TO_FLOAT16_GRAPH = (
    "CAoSCG1oYXNlcnZlOk0KIAoHd2VpZ2h0cxIEaGFsZiIEQ2FzdCoJCgJ0bxgKoAECEgp0b19mbG9hdDE2Wg8KB3dlaWdodHMSBAoCCAFiDAoE"
    "aGFsZhIECgIICkIECgAQEg=="
)

APPEND_GRAPH = (
    "CAoSCG1oYXNlcnZlOmEKKgoEcGFzdAoEcm93cxIHcHJlc2VudCIGQ29uY2F0KgsKBGF4aXMYAqABAhIGYXBwZW5kWgwKBHBhc3QSBAoCCAFa"
    "DAoEcm93cxIECgIIAWIPCgdwcmVzZW50EgQKAggBQgQKABAS"
)


@functools.cache
def _session(graph: str, provider: str = "CPUExecutionProvider") -> ort.InferenceSession:
    # One thread that does not spin: a pool spinning beside the model session's slowed every shaped request
    # (BENCHMARKS.md, "Attention weights shaped per request").
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(base64.b64decode(graph), options, providers=[provider])


def top_k(weights: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest of each row (last axis), highest first, ties by the lower position: (values, positions)."""
    values, indices = _session(TOP_K_GRAPH).run(
        None, {"weights": np.ascontiguousarray(weights, dtype=np.float32), "k": np.array([k], np.int64)}
    )
    return values, indices


def to_float16(weights: np.ndarray) -> np.ndarray:
    return _session(TO_FLOAT16_GRAPH).run(None, {"weights": np.ascontiguousarray(weights, dtype=np.float32)})[0]


def appended(past: ort.OrtValue, rows: ort.OrtValue, provider: str, device: str) -> ort.OrtValue:
    """[B, h, L, d_k] and [B, h, n, d_k] OrtValues on ``device`` as one [B, h, L + n, d_k] there, by a run on
    ``provider``: nothing crosses to the host."""
    session = _session(APPEND_GRAPH, provider)
    binding = session.io_binding()
    binding.bind_ortvalue_input("past", past)
    binding.bind_ortvalue_input("rows", rows)
    binding.bind_output("present", device, 0)
    session.run_with_iobinding(binding)
    return binding.get_outputs()[0]


def build_graphs() -> dict[str, str]:
    """The graphs above, built with onnx (the export extra), base64 of their serialised ModelProto."""
    from onnx import TensorProto, helper

    def serialised(node, name: str, inputs, outputs) -> str:
        graph = helper.make_graph([node], name, inputs, outputs)
        model = helper.make_model(
            graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10, producer_name="mhaserve"
        )
        return base64.b64encode(model.SerializeToString()).decode()

    weights = helper.make_tensor_value_info("weights", TensorProto.FLOAT, None)
    rows_of = {name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in ("past", "rows")}
    return {
        "TOP_K_GRAPH": serialised(
            helper.make_node("TopK", ["weights", "k"], ["values", "indices"], axis=-1, largest=1, sorted=1),
            "top_k",
            [weights, helper.make_tensor_value_info("k", TensorProto.INT64, [1])],
            [
                helper.make_tensor_value_info("values", TensorProto.FLOAT, None),
                helper.make_tensor_value_info("indices", TensorProto.INT64, None),
            ],
        ),
        "TO_FLOAT16_GRAPH": serialised(
            helper.make_node("Cast", ["weights"], ["half"], to=TensorProto.FLOAT16),
            "to_float16",
            [weights],
            [helper.make_tensor_value_info("half", TensorProto.FLOAT16, None)],
        ),
        "APPEND_GRAPH": serialised(
            helper.make_node("Concat", ["past", "rows"], ["present"], axis=2),
            "append",
            [rows_of["past"], rows_of["rows"]],
            [helper.make_tensor_value_info("present", TensorProto.FLOAT, None)],
        ),
    }


if __name__ == "__main__":
    for constant, graph in build_graphs().items():
        print(f"{constant} = {graph!r}")
