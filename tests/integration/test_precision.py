"""A float16 export (`mhaserve export --precision fp16`): validated against float32 eager within its stated
tolerance, served with FP32 inputs and output and the attention weights in FP16, to every client."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import numpy as np
import onnxruntime as ort
import pytest

from mhaserve.client.grpc import Client
from mhaserve.client.http import HttpClient
from mhaserve.contract.model_dir import ModelDirError, read_manifest
from mhaserve.export.onnx_export import export_onnx
from mhaserve.export.validate import TOLERANCES, ValidationCase, validate
from mhaserve.export.writer import revalidate_model_dir
from tests.support import SMALL_D_MODEL, SMALL_HEADS, TEST_SERVER_ARGS, assert_within_relative, eager, rand
from tests.support.in_process import InProcessServer
from tests.support.triton import INPUTS, cases, run_triton_client, triton_http, triton_infer

FP16 = TOLERANCES["fp16"]


@pytest.fixture(scope="module")
def fp16_model_dir(exported, small_module):
    return exported.folder("fp16", small_module, precision="fp16")


@pytest.fixture(scope="module")
def fp16_server(fp16_model_dir):
    with InProcessServer(fp16_model_dir, *TEST_SERVER_ARGS) as process:
        yield process


def test_manifest_and_graph_say_float16_weights_and_float32_everything_else(fp16_model_dir):
    manifest = read_manifest(fp16_model_dir)
    assert manifest["precision"] == "fp16"
    bound = {"max_abs": None, "max_rel": FP16.output.max_rel}
    assert manifest["validation"]["tolerance"] == {"output": bound, "weights": bound}
    assert {t["name"]: t["dtype"] for t in manifest["inputs"] + manifest["outputs"]} == {
        "query": "float32", "key": "float32", "value": "float32", "mask": "bool",
        "output": "float32", "attn_weights": "float16",
    }  # fmt: skip
    session = ort.InferenceSession(str(fp16_model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    assert session.get_modelmeta().custom_metadata_map["mhaserve.precision"] == "fp16"
    assert revalidate_model_dir(fp16_model_dir, seed=1, report=lambda _: None)


def test_the_fp16_tolerance_catches_perturbed_weights(small_module):
    wrong = export_onnx(small_module, precision="fp16")
    for tensor in wrong.graph.initializer:
        if list(tensor.dims) == [SMALL_D_MODEL, SMALL_D_MODEL]:  # one projection matrix, in float16
            import onnx

            w = onnx.numpy_helper.to_array(tensor).copy()
            w[:, 0] += np.float16(0.05)
            tensor.CopyFrom(onnx.numpy_helper.from_array(w, tensor.name))
            break
    cases = [ValidationCase(2, 5, 5, "none"), ValidationCase(2, 7, 3, "key_padding")]
    results = validate(small_module, wrong.SerializeToString(), cases, seed=0, report=lambda _: None, precision="fp16")
    assert not any(r.passed for r in results)


def test_a_fully_masked_row_is_zeros_in_float16_even_with_large_scores(fp16_model_dir, small_module):
    # The masked softmax computes in float32 (half float32's lowest value as the masking bias); the float16
    # part of the graph reads the rows-attending factor through a Cast: a masked row is zeros, not NaN.
    session = ort.InferenceSession(str(fp16_model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    query = rand(1, 6, SMALL_D_MODEL, seed=4) * 8
    allowed = np.ones((1, 1, 6, 6), dtype=bool)
    allowed[0, 0, 2] = False
    out, weights = session.run(None, {"query": query, "key": query, "value": query, "mask": allowed})
    assert np.isfinite(out).all() and np.isfinite(weights).all()
    assert not out[0, 2].any() and not weights[0, :, 2].any()
    want_out, want_weights = eager(small_module, query, query, query, allowed[:, 0])
    assert_within_relative(out, want_out)
    assert_within_relative(weights, want_weights)


def test_tritonclient_gets_fp16_weights_equal_to_float32_eager(fp16_server, small_module, tmp_path):
    results = run_triton_client(fp16_server, tmp_path, "sync")
    for case, arrays in cases().items():
        want_out, want_weights = eager(small_module, *(arrays.get(n) for n in INPUTS))
        assert results[f"{case}_output"].dtype == np.float32
        assert results[f"{case}_attn_weights"].dtype == np.float16
        assert_within_relative(results[f"{case}_output"], want_out)
        assert_within_relative(results[f"{case}_attn_weights"], want_weights)


def test_metadata_and_config_name_fp16_for_the_weights(fp16_server):
    import urllib.request

    base = f"{fp16_server.http_url}/v2/models/mha"
    with urllib.request.urlopen(base, timeout=10) as response:
        metadata = json.load(response)
    with urllib.request.urlopen(base + "/config", timeout=10) as response:
        config = json.load(response)
    assert {t["name"]: t["datatype"] for t in metadata["outputs"]} == {
        "output": "FP32", "attn_weights": "FP16", "attn_weights_mean": "FP16",
        "attn_weights_top_k_values": "FP16", "attn_weights_top_k_indices": "INT64", "attn_weights_entropy": "FP32",
        "attn_weights_sink": "FP16", "attn_weights_max": "FP16", "attn_weights_max_index": "INT64",
    }  # fmt: skip
    assert {t["name"]: t["data_type"] for t in config["output"]} == {
        "output": "TYPE_FP32", "attn_weights": "TYPE_FP16", "attn_weights_mean": "TYPE_FP16",
        "attn_weights_top_k_values": "TYPE_FP16", "attn_weights_top_k_indices": "TYPE_INT64",
        "attn_weights_entropy": "TYPE_FP32", "attn_weights_sink": "TYPE_FP16", "attn_weights_max": "TYPE_FP16",
        "attn_weights_max_index": "TYPE_INT64",
    }  # fmt: skip
    assert {t["datatype"] for t in metadata["inputs"]} == {"FP32", "BOOL"}


def test_our_clients_and_rest_json_get_the_same_fp16_weights(fp16_server, small_module):
    query = rand(2, 9, SMALL_D_MODEL, seed=5)
    with Client(fp16_server.url) as client:
        over_grpc = client.infer(query)
        mean = client.infer(query, attn_weights=False, attn_weights_mean=True).attn_weights_mean
    over_http = HttpClient(fp16_server.http_url.removeprefix("http://")).infer(query)
    over_json = triton_infer(triton_http(fp16_server), query, binary=False)
    _, want_weights = eager(small_module, query)
    assert over_grpc.attn_weights.dtype == over_http.attn_weights.dtype == mean.dtype == np.float16
    assert over_grpc.attn_weights.shape == (2, SMALL_HEADS, 9, 9)
    np.testing.assert_array_equal(over_http.attn_weights, over_grpc.attn_weights)
    np.testing.assert_array_equal(over_json.as_numpy("attn_weights"), over_grpc.attn_weights)
    np.testing.assert_array_equal(over_json.as_numpy("output"), over_grpc.output)
    assert_within_relative(over_grpc.attn_weights, want_weights)
    assert_within_relative(mean, want_weights.mean(axis=1))


def test_inputs_past_the_validated_range_get_an_error_naming_float16_and_the_limit(fp16_server, fp16_model_dir):
    limit = read_manifest(fp16_model_dir)["validation"]["input_scales"]["max_abs_input"]
    query = rand(1, 4, SMALL_D_MODEL, seed=6)
    query *= 1.01 * limit / np.abs(query).max()
    with Client(fp16_server.url) as client, pytest.raises(grpc.RpcError) as error:
        client.infer(query)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    message = error.value.details()
    assert "fp16 export" in message and f"validated for inputs up to {limit:.6g}" in message, message


def test_inputs_float16_cannot_hold_get_an_error_naming_float16_not_inf(fp16_server, fp16_model_dir, small_module):
    # Within the validated range, but every element's sign matches one value-projection row's: that value is
    # past float16's largest once projected. Never an OK answer with Inf in it.
    limit = read_manifest(fp16_model_dir)["validation"]["input_scales"]["max_abs_input"]
    row = small_module.W_v.weight.detach().numpy()[0]
    query = np.broadcast_to(np.sign(row) * np.float32(0.99 * limit), (1, 4, SMALL_D_MODEL)).astype(np.float32)
    assert 0.99 * limit * np.abs(row).sum() > 65504
    with Client(fp16_server.url) as client, pytest.raises(grpc.RpcError) as error:
        client.infer(query)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the computation overflowed float16" in error.value.details()


def test_a_precision_this_version_does_not_serve_is_refused_in_one_line(fp16_model_dir, tmp_path):
    import shutil

    folder = tmp_path / "bf16"
    shutil.copytree(fp16_model_dir, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps(manifest | {"precision": "bf16"}))
    with pytest.raises(ModelDirError, match="precision 'bf16', expected one of fp32, fp16, int8"):
        read_manifest(folder)
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "export", "--precision", "bf16", "--out", str(tmp_path / "x")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "invalid choice: 'bf16'" in done.stderr and "Traceback" not in done.stderr


def test_the_triton_repository_declares_fp16_weights(fp16_model_dir, tmp_path):
    from google.protobuf import text_format

    from mhaserve.export.triton_repo import write_triton_repo
    from mhaserve.protos.generated import model_config_pb2 as mc

    target = write_triton_repo(fp16_model_dir, tmp_path / "repo")
    config = text_format.Parse((target / "config.pbtxt").read_text(), mc.ModelConfig())
    assert {t.name: t.data_type for t in config.output} == {"output": mc.TYPE_FP32, "attn_weights": mc.TYPE_FP16}
    assert {t.data_type for t in config.input} == {mc.TYPE_FP32, mc.TYPE_BOOL}


def test_the_memory_budget_counts_fp16_weights_at_two_bytes_each():
    from mhaserve.server.memory import ANSWER_COPIES, answer_bytes
    from tests.support.requests import as_attention_request

    request = as_attention_request(rand(2, 10, SMALL_D_MODEL), None, None, None, True)
    weights = 2 * SMALL_HEADS * 10 * 10
    halved = answer_bytes(request, SMALL_HEADS, "fp32") - answer_bytes(request, SMALL_HEADS, "fp16")
    assert halved == ANSWER_COPIES * 2 * weights


SCALES = (0.01, 1, 10, 30, 100, 1000)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_every_answer_at_every_input_scale_is_accurate(
    start_server, precision, small_module, small_model_dir, fp16_model_dir
):
    """Query [1, 16, d] at scales where a float16 score product went wrong by a third of a row's mass with OK:
    each answer is within the precision's tolerance of the exact (float64) answer, or no further from it than
    EAGER_ERROR_FACTOR times eager float32 is (inputs past the validated range are refused: the tests above)."""
    import copy

    import torch

    from mhaserve.export.validate import EAGER_ERROR_FACTOR, SCALE_TOLERANCES

    folder = fp16_model_dir if precision == "fp16" else small_model_dir
    exact = copy.deepcopy(small_module).double()
    tolerance = SCALE_TOLERANCES[precision].output.max_rel
    server = start_server(folder, *TEST_SERVER_ARGS)
    with Client(server.url) as client:
        for scale in SCALES:
            for seed in range(3):
                query = rand(1, 16, SMALL_D_MODEL, seed=seed) * np.float32(scale)
                result = client.infer(query)
                with torch.no_grad():
                    want = [t.numpy() for t in exact(torch.from_numpy(query).double())]
                got = (result.output, result.attn_weights)
                in_eager = eager(small_module, query)
                eager_errors = [relative_error(e, w) for e, w in zip(in_eager, want, strict=True)]
                allowed = [max(tolerance, EAGER_ERROR_FACTOR * error) for error in eager_errors]
                errors = [relative_error(g, w) for g, w in zip(got, want, strict=True)]
                assert all(e <= a for e, a in zip(errors, allowed, strict=True)), (scale, seed, errors, allowed)


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / np.max(np.abs(want)))


def test_the_scale_validation_refuses_a_graph_computing_the_scores_in_float16(small_module):
    """The graph float16 exports used to be (everything in float16) holds at unit scale and fails past it."""
    from mhaserve.export.onnx_export import to_float16
    from mhaserve.export.validate import input_limit, validate_scales

    everything_in_float16 = to_float16(export_onnx(small_module), None, ("attn_weights",))
    lines = []
    results = validate_scales(small_module, everything_in_float16.SerializeToString(), 0, lines.append, "fp16")
    by_scale = {r.scale: r.passed for r in results}
    assert by_scale[1.0] and not all(by_scale.values()), lines
    limit = input_limit(results)
    assert limit is not None and limit < 100, lines
    assert f"fp16 holds for inputs up to {limit:.4g}" in lines[-1]


def test_a_float16_folder_without_a_validated_input_range_is_refused_with_the_reason(fp16_model_dir, tmp_path):
    import shutil

    from mhaserve.server.graphs import AttentionGraphs

    folder = tmp_path / "older"
    shutil.copytree(fp16_model_dir, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["validation"]["input_scales"]
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelDirError, match="without a validated input range .* re-export it"):
        AttentionGraphs.open(folder, device="cpu")
