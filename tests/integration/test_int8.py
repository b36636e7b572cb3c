"""An int8 export (`mhaserve export --precision int8`): the four projections in int8, validated against float32
eager within int8's own tolerance (a relative error of the output, an absolute error of the weights), refused where
the policy is not met, and served with FP32 tensors to every client, each answer the same in any batch.

What a user meets depends on the CPU. Where it has 8-bit dot-product instructions (VNNI, AMX, Arm's dot product)
the small module's int8 export is valid and served. Where it has not (an x86 CPU with AVX2 alone), ONNX Runtime's
products saturate: that same export is refused, and so is serving any int8 folder. The tests of a refused export
run on both kinds of CPU: here the refused folder is the small module's own export, there a module whose scores
int8 cannot hold."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import numpy as np
import onnx
import pytest
import torch

from mhaserve.client.grpc import Client
from mhaserve.contract.cpu import int8_support
from mhaserve.contract.model_dir import ModelDirError, read_manifest
from mhaserve.export.validate import TOLERANCES
from mhaserve.export.writer import revalidate_model_dir
from mhaserve.model import seeded_module
from mhaserve.server.graphs import AttentionGraphs
from tests.support import (
    SMALL_D_MODEL,
    SMALL_HEADS,
    TEST_SERVER_ARGS,
    assert_within_relative,
    eager,
    parity_checks,
    rand,
)
from tests.support.in_process import InProcessServer, refused_start
from tests.support.requests import as_attention_request, infer_concurrently, merged_when_all_queued, mixed_requests
from tests.support.triton import INPUTS, cases, run_triton_client

INT8 = TOLERANCES["int8"]
INT8_HERE = int8_support()  # int8_model_dir skips where this CPU cannot run int8; the refused-export tests run anyway


def assert_within_int8(output, weights, want_output, want_weights):
    """The int8 policy: the output within a relative error of its largest magnitude, the weights within an
    absolute error."""
    assert_within_relative(output, want_output, INT8.output)
    if weights is not None:
        assert np.abs(weights.astype(np.float64) - want_weights).max() <= INT8.weights.max_abs


@pytest.fixture(scope="module")
def int8_model_dir(exported, small_module):
    if not INT8_HERE.usable:
        pytest.skip(INT8_HERE.message)
    return exported.folder("int8", small_module, precision="int8")


@pytest.fixture(scope="module")
def int8_server(int8_model_dir):
    with InProcessServer(int8_model_dir, *TEST_SERVER_ARGS) as process:
        yield process


def test_the_manifest_records_int8_its_tolerance_and_every_case(int8_model_dir):
    manifest = read_manifest(int8_model_dir)
    assert manifest["precision"] == "int8" and manifest["valid"]
    validation = manifest["validation"]
    assert validation["tolerance"] == {
        "output": {"max_abs": None, "max_rel": INT8.output.max_rel},
        "weights": {"max_abs": INT8.weights.max_abs, "max_rel": None},
    }
    assert len(validation["cases"]) == 68 and validation["counts"]["fail"] == 0
    assert all(c["output_max_rel"] <= INT8.output.max_rel for c in validation["cases"] if c["status"] == "pass")
    assert validation["worst_failure"] is None
    assert validation["input_scales"]["max_abs_input"] is not None
    # FP32 in and out, as for a float32 export: every client works unchanged.
    assert {t["dtype"] for t in manifest["inputs"] + manifest["outputs"]} == {"float32", "bool"}
    graph = onnx.load(str(int8_model_dir / "model.onnx"))
    assert sum(n.op_type == "MatMulIntegerToFloat" for n in graph.graph.node) == 4
    matrices = [t for t in graph.graph.initializer if len(t.dims) == 2]
    float_weights = {t.name for t in matrices if t.data_type == onnx.TensorProto.FLOAT}
    assert not float_weights, f"float32 projection matrices left in the graph: {float_weights}"
    assert revalidate_model_dir(int8_model_dir, seed=1, report=lambda _: None)


def test_tritonclient_gets_fp32_answers_within_the_int8_policy(int8_server, small_module, tmp_path):
    results = run_triton_client(int8_server, tmp_path, "sync")
    for case, arrays in cases().items():  # self- and cross-attention, key padding, full masks, length 1
        want_out, want_weights = eager(small_module, *(arrays.get(n) for n in INPUTS))
        assert results[f"{case}_output"].dtype == results[f"{case}_attn_weights"].dtype == np.float32
        assert_within_int8(results[f"{case}_output"], results[f"{case}_attn_weights"], want_out, want_weights)


def test_a_fully_masked_row_is_zeros_in_int8(int8_server):
    query = rand(1, 6, SMALL_D_MODEL, seed=4)
    mask = np.ones((1, 6, 6), dtype=bool)
    mask[0, 2] = False
    with Client(int8_server.url) as client:
        result = client.infer(query, mask=mask)
    assert not result.output[0, 2].any() and not result.attn_weights[0, :, 2].any()


def test_an_int8_model_served_with_live_parity_holds_every_answer_to_its_own_weights(int8_model_dir):
    # Each answer recomputed in float64 with the int8 values and scales the file holds, within int8's tolerance, at
    # input scales up to what the export validated (past it the server refuses the request).
    with InProcessServer(int8_model_dir, *TEST_SERVER_ARGS, "--parity-share", "1") as server:
        with Client(server.url) as client:
            for seed in range(6):
                client.infer(rand(2, 9, SMALL_D_MODEL, seed=seed) * np.float32(0.2 * (1 + seed)))
        deadline = time.monotonic() + 30
        while sum((counted := parity_checks(server)).values()) < 6 and time.monotonic() < deadline:
            time.sleep(0.1)
    assert counted == {"held": 6, "breached": 0, "dropped": 0}, counted


def test_each_answer_in_a_batch_across_lengths_equals_its_unbatched_answer(int8_model_dir, small_module):
    # Inputs are rounded per token: a request's answer does not depend on its neighbours in a run, nor on the
    # padding of a run across lengths (one scale per tensor would move it by about the policy's bound).
    requests = mixed_requests(24, seed=5)
    requests[0] = (requests[0][0] * np.float32(0.25), *requests[0][1:])  # a neighbour of another scale
    # One run padded to the longest (length-aware batching would split by a cost model fitted on a busy machine).
    merging = (*merged_when_all_queued(requests), "--length-aware-batching", "false")
    with InProcessServer(int8_model_dir, *TEST_SERVER_ARGS, *merging) as server:
        with Client(server.url) as client:
            before = client.statistics()
            batched = infer_concurrently(server.url, requests)
            merged = client.statistics().execution_count - before.execution_count
    assert merged == 1, f"{len(requests)} concurrent requests took {merged} runs, not one padded run"
    session = AttentionGraphs.open(int8_model_dir, device="cpu", intra_op_threads=1)
    for request, one in zip(requests, batched, strict=True):
        query, key, value, mask, weights = request
        alone = as_attention_request(*request)  # the same request, run by itself
        ran = session.run(alone.outputs, alone.query, alone.key, alone.value, alone.mask)
        other = dict(zip(alone.outputs, ran, strict=True))
        np.testing.assert_allclose(one.output, other["output"], rtol=0, atol=1e-5)
        if weights:
            np.testing.assert_allclose(one.attn_weights, other["attn_weights"], rtol=0, atol=1e-5)
        want_out, want_weights = eager(small_module, query, key, value, mask)
        assert_within_int8(one.output, one.attn_weights if weights else None, want_out, want_weights)


def test_the_config_and_the_triton_repository_say_int8(int8_server, int8_model_dir, tmp_path):
    from google.protobuf import text_format

    from mhaserve.export.triton_repo import write_triton_repo
    from mhaserve.protos.generated import model_config_pb2 as mc

    with urllib.request.urlopen(f"{int8_server.http_url}/v2/models/mha/config", timeout=10) as response:
        parameters = json.load(response)["parameters"]
    assert parameters["precision"] == {"string_value": "int8"}
    assert parameters["computes_in"]["string_value"].startswith("int8 projections")
    target = write_triton_repo(int8_model_dir, tmp_path / "repo")
    config = text_format.Parse((target / "config.pbtxt").read_text(), mc.ModelConfig())
    assert config.parameters["precision"].string_value == "int8"
    assert {t.data_type for t in config.output} == {mc.TYPE_FP32}
    serving = next(line for line in int8_server.lines if "serving model=" in line)
    assert "precision=int8" in serving and "provider=CPUExecutionProvider" in serving, serving


def module_int8_cannot_hold():
    """Query and key projections eight times larger: scores 64 times larger make the softmax turn on differences
    the rounding of Q and K to 8 bits moves (float32 is exact enough for them)."""
    module = seeded_module(SMALL_D_MODEL, SMALL_HEADS, seed=2)
    with torch.no_grad():
        module.W_q.weight *= 8
        module.W_k.weight *= 8
    return module


@pytest.fixture(scope="module")
def refused_export(tmp_path_factory):
    """``mhaserve export --precision int8`` of weights int8 cannot hold on any CPU (a module with sharper scores;
    on a CPU whose int8 products saturate, the small module's own would fail too): (module, the command's result,
    its folder)."""
    from mhaserve.model import save_weights

    module = module_int8_cannot_hold()
    root = tmp_path_factory.mktemp("refused")
    save_weights(module, root / "weights.pt")
    out = root / "mha"
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "export", "--weights", str(root / "weights.pt"), "--precision", "int8",
         "--out", str(out), "--validation-seed", "0"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return module, done, out


def test_an_export_beyond_the_policy_is_refused_naming_the_worst_case(refused_export, exported):
    module, done, out = refused_export
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    verdict = done.stderr.strip().splitlines()[-1]
    assert "NOT valid" in verdict and "worst case:" in verdict and "int8 tolerance" in verdict, verdict
    if not INT8_HERE.usable:  # said before the export's minute of validation, not only after it
        assert INT8_HERE.message in done.stderr
    manifest = read_manifest(out)
    assert manifest["precision"] == "int8" and not manifest["valid"]
    assert manifest["validation"]["worst_failure"] in verdict
    # The same weights in float32 are exported and valid: the refusal is int8's, not the module's.
    assert read_manifest(exported.folder("int8-refused-as-fp32", module))["valid"]


def test_serving_a_refused_int8_folder_is_refused_saying_why(refused_export):
    _, _, out = refused_export
    failure, log = refused_start(out, "--warmup-runs", "0")
    assert failure.exit_code == 3 and "Traceback" not in log, log
    refusal = failure.reason
    # Where the CPU cannot run int8 that is the reason given (a float32 export is the way out), else validation.
    why = INT8_HERE.message if not INT8_HERE.usable else "failed validation"
    assert str(out) in refusal and why in refusal, refusal


def test_a_repository_serves_its_other_versions_beside_a_refused_int8_one(
    refused_export, small_model_dir, small_module, tmp_path
):
    import shutil

    import grpc

    from mhaserve.protos.generated import grpc_service_pb2 as pb
    from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

    _, _, out = refused_export
    repository = tmp_path / "repository"
    shutil.copytree(small_model_dir, repository / "mha" / "1")
    shutil.copytree(out, repository / "mha" / "2")
    query = rand(1, 5, SMALL_D_MODEL, seed=3)
    with InProcessServer(None, *TEST_SERVER_ARGS, "--model-repository", str(repository)) as server:
        with grpc.insecure_channel(server.url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            index = {m.version: (m.state, m.reason) for m in stub.RepositoryIndex(pb.RepositoryIndexRequest()).models}
        with Client(server.url) as client:
            result = client.infer(query)
    # The newest version is refused for the reason serving it alone gives; the one before it serves.
    assert index["1"] == ("READY", ""), index
    state, reason = index["2"]
    assert state == "UNAVAILABLE" and (INT8_HERE.message if not INT8_HERE.usable else "failed validation") in reason
    np.testing.assert_allclose(result.output, eager(small_module, query)[0], rtol=0, atol=1e-5)


def test_validate_inputs_compares_int8_with_float32_on_a_users_npz(int8_model_dir, small_model_dir, tmp_path):
    rng = np.random.default_rng(9)
    query = rng.standard_normal((2, 12, SMALL_D_MODEL), dtype=np.float32)
    keep = np.arange(12)[None, :] < np.array([[9], [12]])
    saved = tmp_path / "requests.npz"
    np.savez(saved, query=query, mask=keep)

    def validate(*args):
        return subprocess.run(
            [sys.executable, "-m", "mhaserve.cli", "validate", str(int8_model_dir), "--inputs", *args],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    against_eager = validate(str(saved))
    assert against_eager.returncode == 0, against_eager.stderr
    assert "within the int8 tolerance" in against_eager.stderr and "output abs" in against_eager.stderr
    against_folder = validate(str(saved), "--against", str(small_model_dir))
    assert against_folder.returncode == 0 and str(small_model_dir) in against_folder.stderr, against_folder.stderr
    # Inputs past the validated range, where the rounding of Q and K moves the weights: it says so and exits 1.
    np.savez(saved, query=query * np.float32(4), mask=keep)
    beyond = validate(str(saved))
    assert beyond.returncode == 1 and "NOT within the int8 tolerance" in beyond.stderr, beyond.stderr
    missing = validate(str(tmp_path / "none.npz"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and "--inputs" in missing.stderr


def test_a_valid_int8_folder_is_refused_on_a_cpu_whose_products_saturate(int8_model_dir, tmp_path, monkeypatch):
    from mhaserve.server import model_folder

    avx2 = tmp_path / "cpuinfo"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    monkeypatch.setattr(model_folder, "int8_support", lambda: int8_support(avx2))
    with pytest.raises(ModelDirError, match="no 8-bit dot-product instructions.*serve a float32 export here"):
        model_folder.ModelFolder.read(int8_model_dir, device="cpu")


def test_device_cuda_with_an_int8_folder_is_refused_saying_why(int8_model_dir):
    failure, log = refused_start(int8_model_dir, "--device", "cuda", "--warmup-runs", "0")
    assert failure.exit_code == 3, log
    assert failure.reason.startswith("cannot serve: --device cuda:") and "int8 export" in failure.reason
