"""The CUDA path on a real GPU: the provider really active, answers equal eager PyTorch on the same GPU,
batching across lengths, sequence steps with their cache in the GPU's memory, and a long run that does not grow
the GPU's memory.

Skipped, with the reason, where no GPU is usable: CI installs the CPU build of onnxruntime. On a GPU
machine, benchmarks/gpu/setup.sh installs onnxruntime-gpu first on PYTHONPATH; then benchmarks/gpu/check.sh
runs these tests (and the benchmarks) from outside the checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import numpy as np
import onnxruntime as ort
import pytest

from mhaserve.client.grpc import Client
from mhaserve.export.validate import TOLERANCES
from mhaserve.export.writer import export_model_dir
from mhaserve.server.process import ServerProcess
from tests.support import SMALL_D_MODEL, TEST_SERVER_ARGS, assert_within_relative, parity_checks, rand
from tests.support.requests import infer_concurrently, mixed_requests


def cuda_unusable() -> str | None:
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return f"this onnxruntime has no CUDA provider ({', '.join(ort.get_available_providers())})"
    import torch

    if not torch.cuda.is_available():
        return "torch sees no GPU here"
    return None


pytestmark = pytest.mark.skipif(cuda_unusable() is not None, reason=f"no usable GPU: {cuda_unusable()}")

# TF32 rounds a float32 product's inputs to 10 bits of mantissa, as float16 does: the same relative bound.
TF32 = TOLERANCES["fp16"].output


def eager_on_gpu(module, query, key=None, value=None, mask=None):
    """The module's (output, attn_weights) computed on the GPU in float32 (torch leaves TF32 off for matmul)."""
    import torch

    assert not torch.backends.cuda.matmul.allow_tf32
    gpu = module.to("cuda")
    with torch.no_grad():
        args = [None if a is None else torch.from_numpy(np.asarray(a)).to("cuda") for a in (query, key, value, mask)]
        out, attn = gpu(*args)
    module.to("cpu")
    return out.cpu().numpy(), attn.cpu().numpy()


def provider_of(server: ServerProcess) -> str:
    line = next(line for line in server.lines if "serving model=" in line)
    return line.split("provider=")[1].split()[0]


@pytest.fixture(scope="module")
def gpu_server(small_model_dir):
    with ServerProcess(small_model_dir, "--device", "cuda", "--cuda-tf32", "true", *TEST_SERVER_ARGS) as process:
        yield process


@pytest.fixture(scope="module")
def exact_gpu_server(small_model_dir):
    with ServerProcess(small_model_dir, "--device", "cuda", "--cuda-tf32", "false", *TEST_SERVER_ARGS) as process:
        yield process


def test_device_cuda_and_auto_both_serve_on_the_cuda_provider(start_server_process, gpu_server, small_model_dir):
    # The server's own check: the session's first provider, not the list of providers built in.
    assert provider_of(gpu_server) == "CUDAExecutionProvider"
    auto = start_server_process(small_model_dir, "--device", "auto", *TEST_SERVER_ARGS)
    assert provider_of(auto) == "CUDAExecutionProvider"


def test_exact_float32_answers_equal_eager_on_the_gpu(exact_gpu_server, small_module):
    for seed, (b, lq, lk) in enumerate(((1, 1, 1), (2, 7, 7), (3, 40, 17))):
        query, key = rand(b, lq, SMALL_D_MODEL, seed=seed), rand(b, lk, SMALL_D_MODEL, seed=seed + 10)
        mask = np.random.default_rng(seed).random((b, lk)) < 0.7
        mask[:, 0] = True
        with Client(exact_gpu_server.url) as client:
            result = client.infer(query, key, key, mask)
        want_out, want_attn = eager_on_gpu(small_module, query, key, key, mask)
        np.testing.assert_allclose(result.output, want_out, rtol=0, atol=1e-5)
        np.testing.assert_allclose(result.attn_weights, want_attn, rtol=0, atol=1e-5)


@pytest.mark.parametrize("keys", [64, 40], ids=["keys in whole blocks", "keys past the blocks"])
def test_summaries_from_the_summaries_graph_on_the_gpu_equal_float64(exact_gpu_server, small_module, keys):
    """The summaries graph on the CUDA provider (its top key searched by blocks, or one by one): each head's row
    summaries within float32's tolerance of the float64 module's, the largest weight's key wherever the row's two
    largest weights differ by more."""
    import torch

    from mhaserve.client import WeightsOptions
    from mhaserve.export.summaries import ENTROPY_WITHIN, WEIGHTS_WITHIN, exact_summaries

    query = rand(2, keys, SMALL_D_MODEL, seed=keys)
    mask = np.ones((2, keys, keys), bool)
    mask[1, :, keys // 2 :] = False
    mask[1, 3] = False  # a row that may attend no key
    with Client(exact_gpu_server.url) as client:
        got = client.infer(query, mask=mask, attn_weights=False, weights=WeightsOptions(summaries=True)).summaries
    with torch.no_grad():
        exact = small_module.double()
        weights = exact(torch.from_numpy(query.astype(np.float64)), mask=torch.from_numpy(mask))[1].numpy()
        small_module.float()
    want = {name.removeprefix("attn_weights_"): value for name, value in exact_summaries(weights).items()}
    np.testing.assert_allclose(got["entropy"], want["entropy"], rtol=0, atol=ENTROPY_WITHIN)
    for name in ("sink", "max"):
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=WEIGHTS_WITHIN, err_msg=name)
    ordered = np.sort(weights, axis=-1)
    clear = ordered[..., -1] - ordered[..., -2] > WEIGHTS_WITHIN
    np.testing.assert_array_equal(got["max_index"][clear], want["max_index"][clear])
    assert got["max_index"][1, :, 3].tolist() == [-1] * got["max_index"].shape[1]


def test_tf32_answers_are_within_its_stated_tolerance(gpu_server, small_module):
    query = rand(2, 33, SMALL_D_MODEL, seed=3)
    with Client(gpu_server.url) as client:
        result = client.infer(query)
    want_out, want_attn = eager_on_gpu(small_module, query)
    assert_within_relative(result.output, want_out, TF32)
    assert_within_relative(result.attn_weights, want_attn, TF32)


@pytest.mark.parametrize("tf32", ["false", "true"])
def test_live_parity_holds_the_gpu_s_answers_to_the_bound_of_their_arithmetic(small_model_dir, tf32):
    # Exact float32 products within float32's 1e-5 of float64; TF32 ones within float16's bound (TF32_BOUND),
    # where float32's would count each answer a breach.
    args = ("--device", "cuda", "--cuda-tf32", tf32, "--parity-share", "1", *TEST_SERVER_ARGS)
    with ServerProcess(small_model_dir, *args) as server, Client(server.url) as client:
        for seed in range(8):
            client.infer(rand(2, 33, SMALL_D_MODEL, seed=seed) * np.float32(3))
        deadline = time.monotonic() + 60
        while sum((counted := parity_checks(server)).values()) < 8 and time.monotonic() < deadline:
            time.sleep(0.1)
        worst = dict(client.statistics().parity.worst_error)
    assert counted == {"held": 8, "breached": 0, "dropped": 0}, (counted, worst)
    print(f"--cuda-tf32 {tf32}: the worst errors against float64 {worst}")


def test_float16_export_on_the_gpu_is_within_its_tolerance_of_float32_eager(
    start_server_process, small_module, tmp_path
):
    folder = tmp_path / "fp16"
    assert export_model_dir(small_module, folder, precision="fp16", validation_seed=0, report=lambda _: None)["valid"]
    query = rand(2, 40, SMALL_D_MODEL, seed=5)
    server = start_server_process(folder, "--device", "cuda", *TEST_SERVER_ARGS)
    with Client(server.url) as client:
        assert provider_of(server) == "CUDAExecutionProvider"
        result = client.infer(query)
    want_out, want_attn = eager_on_gpu(small_module, query)
    assert result.attn_weights.dtype == np.float16
    assert_within_relative(result.output, want_out, TOLERANCES["fp16"].output)
    assert_within_relative(result.attn_weights, want_attn, TOLERANCES["fp16"].output)


def test_an_int8_export_is_served_on_the_cpu_provider_on_a_gpu_machine(start_server_process, small_module, tmp_path):
    # Its uint8 x int8 products have no CUDA kernel: --device auto serves it on the CPU (cuda is refused).
    from mhaserve.contract.cpu import int8_support

    if not (support := int8_support()).usable:
        pytest.skip(support.message)
    folder = tmp_path / "int8"
    assert export_model_dir(small_module, folder, precision="int8", validation_seed=0, report=lambda _: None)["valid"]
    server = start_server_process(folder, *TEST_SERVER_ARGS)
    with Client(server.url) as client:
        client.infer(rand(2, 40, SMALL_D_MODEL, seed=5))
    assert provider_of(server) == "CPUExecutionProvider"


def test_tritonclient_is_served_on_the_gpu(exact_gpu_server, small_module, tmp_path):
    from tests.support.triton import INPUTS, cases, run_triton_client

    results = run_triton_client(exact_gpu_server, tmp_path, "sync")
    for case, arrays in cases().items():
        want_out, want_attn = eager_on_gpu(small_module, *(arrays.get(n) for n in INPUTS))
        np.testing.assert_allclose(results[f"{case}_output"], want_out, rtol=0, atol=1e-5)
        np.testing.assert_allclose(results[f"{case}_attn_weights"], want_attn, rtol=0, atol=1e-5)


def test_concurrent_mixed_lengths_are_batched_on_the_gpu_each_equal_eager(
    start_server_process, small_model_dir, small_module
):
    requests = mixed_requests(24, seed=5)
    args = ("--device", "cuda", "--cuda-tf32", "false", "--max-batch-size", "64", "--max-q-len", "64",
            "--max-kv-len", "64", "--max-queue-delay-us", "30000", "--warmup-runs", "1")  # fmt: skip

    server = start_server_process(small_model_dir, *args)
    with Client(server.url) as client:
        before = client.statistics()
        results = infer_concurrently(server.url, requests)
        after = client.statistics()
    for (query, key, value, mask, weights), result in zip(requests, results, strict=True):
        want_out, want_attn = eager_on_gpu(small_module, query, key, value, mask)
        np.testing.assert_allclose(result.output, want_out, rtol=0, atol=1e-5)
        if weights:
            np.testing.assert_allclose(result.attn_weights, want_attn, rtol=0, atol=1e-5)
    assert after.execution_count - before.execution_count < len(requests) // 2  # merged, across lengths


def gpu_memory_used_mib() -> int:
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return int(done.stdout.strip().splitlines()[0])


@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="nvidia-smi is not on PATH")
def test_a_long_mixed_run_does_not_grow_gpu_memory(gpu_server):
    def send(count, seed):
        for start in range(0, count, 16):
            infer_concurrently(gpu_server.url, mixed_requests(16, seed=seed + start))

    send(400, seed=100)  # every shape class seen: the arena has grown to what the traffic needs
    settled = gpu_memory_used_mib()
    send(4000, seed=10_000)
    after = gpu_memory_used_mib()
    assert after - settled <= 64, f"GPU memory grew from {settled} to {after} MiB over 4000 more requests"
    with Client(gpu_server.url) as client:
        assert client.statistics().inference_count >= 4400


def test_sequence_steps_on_the_gpu_equal_the_causal_answer_with_the_cache_in_gpu_memory(
    start_server, small_model_dir, small_module
):
    server = start_server(small_model_dir, "--device", "cuda", "--cuda-tf32", "false", *TEST_SERVER_ARGS)
    x = rand(2, 60, SMALL_D_MODEL, seed=8)
    steps = [1, 3, 8, 1, 7, 2, 8, 8, 1, 5, 8, 8]
    assert sum(steps) == x.shape[1]
    want_out, want_attn = eager_on_gpu(small_module, x, mask=np.tril(np.ones((1, 60, 60), bool)))
    with Client(server.url) as client, client.sequence("on-gpu") as sequence:
        position = 0
        for rows in steps:
            result = sequence.step(x[:, position : position + rows])
            end = position + rows
            np.testing.assert_allclose(result.output, want_out[:, position:end], rtol=0, atol=1e-5)
            np.testing.assert_allclose(result.attn_weights, want_attn[:, :, position:end, :end], rtol=0, atol=1e-5)
            position = end
        live = server.server.dataplane.sequences.live  # keyed by (caller, id)
        cache = next(sequence.cache for (_, id_), sequence in live.items() if id_ == "on-gpu")
        assert (cache.device, cache.length) == ("cuda", 60)
        sequence.step(x[:, :1], end=True)
    assert server.server.dataplane.sequences.live == {}
