"""Attention weights shaped per request, on a real server: heads, rows, a key window, top-k and top-p, FP16
weights, through the project's gRPC and HTTP clients, tritonclient.grpc (its own process) and tritonclient.http
(binary and JSON); each answer equal to the same selection of the full weights, and to eager PyTorch; mixed
options sharing batched runs; every bad parameter refused with a message naming it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import grpc
import numpy as np
import pytest

from mhaserve.client import AsyncClient, Client, HttpClient, HttpRequestFailed, WeightsOptions
from tests.support import SMALL_D_MODEL, SMALL_HEADS, TEST_SERVER_ARGS, eager, rand
from tests.support.triton import run_triton_client, triton_http, triton_infer

D, H = SMALL_D_MODEL, SMALL_HEADS
TOP_K = ("attn_weights_top_k_values", "attn_weights_top_k_indices")
ACROSS_RUNS = 1e-6  # two requests are two runs: the tolerance batching already allows


def reference_top(weights: np.ndarray, k: int | None = None, p: float | None = None):
    """Top-k (or top-p) by sorting every row: weight, highest first, ties by the lower key position."""
    values = np.zeros((*weights.shape[:-1], weights.shape[-1]), weights.dtype)
    indices = np.full(values.shape, -1, np.int64)
    largest = 0
    for index in np.ndindex(weights.shape[:-1]):
        row = weights[index]
        order = np.array(sorted(range(len(row)), key=lambda i: (-float(row[i]), i)))
        if k is not None:
            count = k
        elif row.sum() == 0:
            count = 0
        else:
            running = np.cumsum(row[order].astype(np.float64))
            count = int(np.argmax(running >= p * running[-1])) + 1
        values[index][:count], indices[index][:count] = row[order[:count]], order[:count]
        largest = max(largest, count)
    return values[..., :largest], indices[..., :largest]


def inputs_with_ties():
    """Two sequences; a padding mask gives the second zeros beyond its length: ties, and a fully masked row."""
    query = rand(2, 12, D, seed=21)
    mask = np.ones((2, 12, 12), bool)
    mask[1, :, 7:] = False
    mask[1, 3] = False  # a row that may attend nowhere: its weights are zeros
    return query, mask


@pytest.fixture(scope="module")
def full(server):
    query, mask = inputs_with_ties()
    with Client(server.url) as client:
        return client.infer(query, mask=mask).attn_weights


OPTIONS = {
    "one head": (WeightsOptions(heads=[2]), lambda w: {"attn_weights": w[:, [2]]}),
    "heads": (WeightsOptions(heads=[3, 0]), lambda w: {"attn_weights": w[:, [3, 0]]}),
    "rows": (WeightsOptions(rows="2:9"), lambda w: {"attn_weights": w[:, :, 2:9]}),
    "keys": (WeightsOptions(keys=slice(-5, None)), lambda w: {"attn_weights": w[..., 7:]}),
    "combined": (WeightsOptions(heads=[1], rows=(0, 4), keys="3:10"), lambda w: {"attn_weights": w[:, [1], 0:4, 3:10]}),
}


@pytest.mark.parametrize("name", OPTIONS)
@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_a_selection_is_that_selection_of_the_full_weights(server, full, name, transport):
    options, select = OPTIONS[name]
    query, mask = inputs_with_ties()
    client = Client(server.url) if transport == "grpc" else HttpClient(server.http_url.removeprefix("http://"))
    with client:
        result = client.infer(query, mask=mask, weights=options, attn_weights_mean=True)
    expected = select(full)
    np.testing.assert_allclose(result.attn_weights, expected["attn_weights"], rtol=0, atol=ACROSS_RUNS)
    np.testing.assert_allclose(result.attn_weights_mean, expected["attn_weights"].mean(axis=1), atol=ACROSS_RUNS)
    assert result.output.shape == (2, 12, D)


@pytest.mark.parametrize("transport", ["grpc", "http"])
def test_top_k_and_top_p_equal_a_reference_over_the_full_weights_with_ties(server, full, transport):
    query, mask = inputs_with_ties()
    client = Client(server.url) if transport == "grpc" else HttpClient(server.http_url.removeprefix("http://"))
    with client:
        by_k = client.infer(query, mask=mask, attn_weights=False, weights=WeightsOptions(top_k=9))
        by_p = client.infer(query, mask=mask, attn_weights=False, weights=WeightsOptions(top_p=0.8, heads=[0, 1]))
    for result, (values, indices) in ((by_k, reference_top(full, k=9)), (by_p, reference_top(full[:, :2], p=0.8))):
        got_values, got_indices = result.top_k
        # Rows with ties beyond float32's resolution differ between runs only where weights differ by < 1e-6.
        np.testing.assert_allclose(got_values, values, rtol=0, atol=ACROSS_RUNS)
        assert (got_indices == indices).mean() > 0.99 and got_indices.dtype == np.int64
        np.testing.assert_allclose(np.take_along_axis(full[:, : got_values.shape[1]], np.maximum(got_indices, 0), -1)
                                   * (got_indices >= 0), got_values, atol=ACROSS_RUNS)  # fmt: skip
    assert (by_k.top_k[1][1, :, 3] == np.arange(9)).all()  # the masked row: all zeros, ties by position
    assert (by_p.top_k[1][1, :, 3] == -1).all() and (by_p.top_k[0][1, :, 3] == 0).all()


def test_fp16_weights_are_the_fp32_ones_rounded_at_half_the_bytes(server, full):
    query, mask = inputs_with_ties()
    with Client(server.url) as client:
        result = client.infer(query, mask=mask, weights=WeightsOptions(precision="fp16"))
    assert result.attn_weights.dtype == np.float16 and result.output.dtype == np.float32
    np.testing.assert_allclose(result.attn_weights.astype(np.float32), full.astype(np.float16), rtol=1e-3, atol=1e-6)


def test_answers_stay_equal_to_eager(server, small_module):
    query, mask = inputs_with_ties()
    _, weights = eager(small_module, query, mask=mask)
    with Client(server.url) as client:
        result = client.infer(query, mask=mask, weights=WeightsOptions(heads=[1, 2], rows="1:5", top_k=3))
    values, indices = reference_top(weights[:, [1, 2], 1:5], k=3)
    np.testing.assert_allclose(result.top_k[0], values, atol=1e-5)
    assert set(result.outputs) == {"output", "attn_weights", *TOP_K}  # the client asks for the weights too
    np.testing.assert_allclose(result.attn_weights, weights[:, [1, 2], 1:5], atol=1e-5)


@pytest.mark.parametrize("mode", ["sync", "aio"])
def test_tritonclient_grpc_asks_through_request_parameters(server, full, tmp_path, mode):
    query, mask = inputs_with_ties()
    parameters = {"attn_heads": "0,2", "attn_rows": "0:6", "attn_top_k": 4}
    answers = run_triton_client(server, tmp_path, mode, {"case0": {"query": query, "mask": mask}},
                                outputs=",".join(TOP_K), parameters=parameters)  # fmt: skip
    values, indices = reference_top(full[:, [0, 2], 0:6], k=4)
    np.testing.assert_allclose(answers["case0_attn_weights_top_k_values"], values, atol=ACROSS_RUNS)
    assert (answers["case0_attn_weights_top_k_indices"] == indices).mean() > 0.99


@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_http_asks_through_request_parameters_binary_and_json(server, full, binary):
    query, mask = inputs_with_ties()
    client = triton_http(server)
    parameters = {"attn_keys": "2:8", "attn_weights_precision": "FP16", "attn_heads": 3}
    result = triton_infer(client, query, mask, binary, outputs=("attn_weights",), parameters=parameters)
    weights = result.as_numpy("attn_weights")
    assert weights.dtype == np.float16
    np.testing.assert_allclose(weights.astype(np.float32), full[:, [3], :, 2:8].astype(np.float16), rtol=1e-3)


def test_metadata_and_config_list_the_top_k_outputs(server):
    with Client(server.url) as client:
        outputs = {o.name: (o.datatype, list(o.shape)) for o in client.metadata().outputs}
    assert outputs["attn_weights_top_k_values"] == ("FP32", [-1, -1, -1, -1])
    assert outputs["attn_weights_top_k_indices"] == ("INT64", [-1, -1, -1, -1])
    with urllib.request.urlopen(f"{server.http_url}/v2/models/mha/config", timeout=10) as answer:
        config = json.loads(answer.read())
    assert {o["name"] for o in config["output"]} >= set(TOP_K)


BAD = [
    ({"attn_heads": "0,9"}, "head 9"),
    ({"attn_rows": "4:2"}, "attn_rows"),
    ({"attn_top_k": 0}, "1..12"),
    ({"attn_top_p": "2"}, "(0, 1]"),
    ({"attn_weights_precision": "BF16"}, "FP32 or FP16"),
    ({"attn_heads": "x"}, "'x'"),
]


@pytest.mark.parametrize(("parameters", "words"), BAD)
def test_a_bad_parameter_is_refused_naming_it_over_grpc_and_http(server, parameters, words):
    from mhaserve.client.grpc import build_infer_request
    from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

    query, mask = inputs_with_ties()
    request = build_infer_request("mha", query, mask=mask)
    for name, value in parameters.items():
        setattr(request.parameters[name], "string_param" if isinstance(value, str) else "int64_param", value)
    with grpc.insecure_channel(server.url) as channel, pytest.raises(grpc.RpcError) as refused:
        pb_grpc.GRPCInferenceServiceStub(channel).ModelInfer(request, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert next(iter(parameters)) in refused.value.details() and words in refused.value.details()
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as http_refused:
        triton_infer(triton_http(server), query, mask, parameters=parameters)
    assert http_refused.value.status() == "400" and next(iter(parameters)) in http_refused.value.message()


def test_shaping_a_request_without_weights_outputs_is_refused(server):
    with HttpClient(server.http_url.removeprefix("http://")) as client, pytest.raises(HttpRequestFailed) as refused:
        client.infer(rand(1, 4, D), attn_weights=False, weights=WeightsOptions(heads=[0]))
    assert refused.value.http_status == 400 and "attn_heads" in refused.value.details


def test_mixed_options_share_batched_runs_and_each_equals_its_own_answer(start_server, small_model_dir, small_module):
    # A 30 ms queue delay makes merging certain: eight requests, each shaped its own way, in few runs.
    server = start_server(small_model_dir, *TEST_SERVER_ARGS, "--max-queue-delay-us", "30000")
    options = [
        WeightsOptions(),
        WeightsOptions(heads=[1]),
        WeightsOptions(rows="0:3", keys="1:"),
        WeightsOptions(top_k=2),
        WeightsOptions(top_p=0.5, heads=[0, 3]),
        WeightsOptions(precision="fp16"),
        WeightsOptions(heads=[2], top_k=1),
        None,
    ]
    queries = [rand(1, 4 + i, D, seed=40 + i) for i in range(len(options))]

    async def all_at_once():
        async with AsyncClient(server.url) as client:
            return await asyncio.gather(*(client.infer(q, weights=o) for q, o in zip(queries, options, strict=True)))

    results = asyncio.run(all_at_once())
    with Client(server.url) as client:
        stats = client.statistics()
    assert stats.execution_count < stats.inference_count  # the requests shared runs
    for query, option, result in zip(queries, options, results, strict=True):
        output, weights = eager(small_module, query)
        np.testing.assert_allclose(result.output, output, atol=1e-5)
        with Client(server.url) as client:
            alone = client.infer(query, weights=option)
        for name, array in result.outputs.items():
            np.testing.assert_allclose(array.astype(np.float32), alone.outputs[name].astype(np.float32), atol=1e-3
                                       if array.dtype == np.float16 else ACROSS_RUNS)  # fmt: skip


def test_the_cli_asks_for_shaped_weights_saves_them_and_draws_top_keys_as_a_sparse_map(server, tmp_path):
    pytest.importorskip("matplotlib")
    png, saved = tmp_path / "top.png", tmp_path / "answer.npz"
    command = [sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url, "--q-len", "6", "--heads", "1,3",
               "--rows", "0:4", "--top-k", "2", "--no-weights", "--heatmap", str(png), "--head", "3",
               "--save", str(saved)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "attn_weights_top_k_values: [1, 2, 4, 2]" in done.stdout and "head 3, top keys" in done.stdout
    answer = np.load(saved)
    assert answer["attn_weights_top_k_indices"].shape == (1, 2, 4, 2) and png.stat().st_size > 0
    refused = subprocess.run([*command[:6], "--heads", "9"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "attn_heads" in refused.stderr and "Traceback" not in refused.stderr


def test_bench_sends_shaped_requests(server, tmp_path):
    command = [sys.executable, "-m", "mhaserve.cli", "bench", "--url", server.url, "--concurrency", "2",
               "--duration", "1", "--warmup", "0.2", "--processes", "1", "--top-k", "4", "--heads", "0",
               "--json", str(tmp_path / "bench.json")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (point,) = json.loads((tmp_path / "bench.json").read_text())["points"]
    assert point["requests"] > 0 and point["errors"] == 0
    assert json.loads(point["weights_options"]) == {"attn_heads": "0", "attn_top_k": 4}


def test_a_request_naming_no_outputs_with_top_k_gets_the_output_and_both_top_k_outputs(server):
    query = rand(1, 5, D, seed=5)
    body = {
        "inputs": [{"name": "query", "shape": list(query.shape), "datatype": "FP32", "data": query.ravel().tolist()}],
        "parameters": {"attn_top_k": "2"},
    }
    request = urllib.request.Request(f"{server.http_url}/v2/models/mha/infer", json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as answer:
        outputs = {o["name"]: (o["datatype"], o["shape"]) for o in json.loads(answer.read())["outputs"]}
    assert outputs == {
        "output": ("FP32", [1, 5, D]),
        "attn_weights_top_k_values": ("FP32", [1, H, 5, 2]),
        "attn_weights_top_k_indices": ("INT64", [1, H, 5, 2]),
    }


@pytest.mark.parametrize("binary", [True, False])
def test_top_k_outputs_asked_for_without_a_ranking_come_back_empty(server, binary):
    query, mask = inputs_with_ties()
    result = triton_infer(triton_http(server), query, mask, binary, outputs=("output", *TOP_K))
    assert result.as_numpy("attn_weights_top_k_values").shape == (2, H, 12, 0)
    assert result.as_numpy("attn_weights_top_k_indices").shape == (2, H, 12, 0)
    assert result.as_numpy("output").shape == (2, 12, D)
