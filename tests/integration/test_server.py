"""The gRPC server, called over loopback by the project's clients: answers equal eager PyTorch, the protocol
RPCs, requested outputs, streaming, statistics, device choice, and a server process that never loads torch."""

from __future__ import annotations

import asyncio
import queue
import re
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from mhaserve.client.grpc import AsyncClient, Client, GrpcRequestFailed, build_infer_request
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support import SMALL_D_MODEL, SMALL_HEADS, TEST_SERVER_ARGS, eager, rand

D, H = SMALL_D_MODEL, SMALL_HEADS


def cases():
    """(query, key, value, mask): batch 1, length 1, Lq != Lk, key padding, a full mask with a fully masked row."""
    padding = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=bool)
    full = np.random.default_rng(1).random((2, 6, 6)) < 0.7
    full[:, :, 0] = True
    full[1, 3, :] = False
    return [
        (rand(1, 1, D, seed=1), None, None, None),
        (rand(1, 16, D, seed=2), None, None, None),
        (rand(2, 3, D, seed=3), rand(2, 9, D, seed=4), rand(2, 9, D, seed=5), None),
        (rand(3, 4, D, seed=6), rand(3, 5, D, seed=7), rand(3, 5, D, seed=8), padding),
        (rand(2, 6, D, seed=9), None, None, full),
        (rand(1, 1, D, seed=10), rand(1, 7, D, seed=11), None, np.array([[1, 1, 0, 0, 0, 0, 1]], dtype=np.int32)),
    ]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.url) as c:
        yield c


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.url) as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.mark.parametrize("index", range(len(cases())))
def test_client_answers_equal_eager(client, small_module, index):
    query, key, value, mask = cases()[index]
    result = client.infer(query, key, value, mask)
    want_out, want_attn = eager(small_module, query, key, value, mask)
    assert result.output.shape == want_out.shape and result.attn_weights.shape == want_attn.shape
    np.testing.assert_allclose(result.output, want_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(result.attn_weights, want_attn, rtol=0, atol=1e-5)


def test_client_takes_torch_tensors_as_a_model_leaves_them(server, small_module):
    # Needing grad, bfloat16: taken as their values, as NumPy arrays of them would be (torch never imported by it)
    torch = pytest.importorskip("torch")
    query = torch.from_numpy(rand(1, 5, D, seed=12))
    mask = torch.tensor([[True, True, True, False, False]])
    for given, sent in ((query.clone().requires_grad_(), query), (query.bfloat16(), query.bfloat16().float())):
        with Client(server.url) as client:
            got = client.infer(given, mask=mask)
        np.testing.assert_allclose(got.output, eager(small_module, sent.numpy(), mask=mask.numpy())[0], atol=1e-5)
    with Client(server.url) as client, pytest.raises(GrpcRequestFailed) as refused:
        client.infer(query, mask=mask.float())  # PyTorch adds a float mask: 0 would mean the opposite here
    assert "a float mask is not read: 0 means may not attend here" in refused.value.details()


def test_async_client_answers_equal_eager(server, small_module):
    async def main():
        async with AsyncClient(server.url) as client:
            return await asyncio.gather(*(client.infer(q, k, v, m) for q, k, v, m in cases()))

    for (query, key, value, mask), result in zip(cases(), asyncio.run(main()), strict=True):
        want_out, want_attn = eager(small_module, query, key, value, mask)
        np.testing.assert_allclose(result.output, want_out, rtol=0, atol=1e-5)
        np.testing.assert_allclose(result.attn_weights, want_attn, rtol=0, atol=1e-5)


def test_typed_contents_are_accepted(stub, small_module):
    query = rand(1, 3, D, seed=12)
    request = pb.ModelInferRequest(model_name="mha")
    tensor = request.inputs.add(name="query", datatype="FP32", shape=query.shape)
    tensor.contents.fp32_contents.extend(query.ravel().tolist())
    mask = request.inputs.add(name="mask", datatype="BOOL", shape=[1, 3])
    mask.contents.bool_contents.extend([True, True, False])
    response = stub.ModelInfer(request)
    # responses always use raw_output_contents
    assert [o.name for o in response.outputs] == ["output", "attn_weights"] and len(response.raw_output_contents) == 2
    out = np.frombuffer(response.raw_output_contents[0], dtype=np.float32).reshape(1, 3, D)
    np.testing.assert_allclose(out, eager(small_module, query, mask=np.array([[1, 1, 0]], dtype=bool))[0], atol=1e-5)


def test_only_the_requested_outputs_are_returned(stub, client):
    query = rand(1, 8, D, seed=13)
    response = stub.ModelInfer(build_infer_request("mha", query, attn_weights=False))
    assert [o.name for o in response.outputs] == ["output"] and len(response.raw_output_contents) == 1
    request = build_infer_request("mha", query)
    del request.outputs[:]
    request.outputs.add(name="attn_weights")
    response = stub.ModelInfer(request)
    assert [o.name for o in response.outputs] == ["attn_weights"]
    assert list(response.outputs[0].shape) == [1, H, 8, 8]
    result = client.infer(query, attn_weights=False)
    assert result.attn_weights is None and result.output.shape == (1, 8, D)


def test_both_clients_say_whether_the_server_is_ready_and_wait_for_it(server):
    import socket

    from mhaserve.client import HttpClient

    with Client(server.url) as grpc_client, HttpClient(server.http_url.removeprefix("http://")) as http_client:
        assert grpc_client.server_ready() and http_client.server_ready()
        grpc_client.wait_ready(timeout=5)
        http_client.wait_ready(timeout=5)
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{unused.getsockname()[1]}"
    with Client(nowhere) as grpc_client, HttpClient(nowhere) as http_client:
        assert not grpc_client.server_ready(timeout=2) and not http_client.server_ready(timeout=2)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="not ready after 0.5 s"):
            http_client.wait_ready(timeout=0.5)
        assert time.monotonic() - started < 5


def test_liveness_readiness_and_server_metadata(stub):
    assert stub.ServerLive(pb.ServerLiveRequest()).live
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="mha")).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name="mha", version="1")).ready
    meta = stub.ServerMetadata(pb.ServerMetadataRequest())
    assert meta.name == "mhaserve" and "model_configuration" in meta.extensions


def test_model_metadata_has_dynamic_dims_as_minus_one(stub):
    meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="mha"))
    assert meta.name == "mha" and list(meta.versions) == ["1"] and meta.platform == "onnxruntime_onnx"
    inputs = {t.name: (t.datatype, list(t.shape)) for t in meta.inputs}
    assert inputs == {
        "query": ("FP32", [-1, -1, D]),
        "key": ("FP32", [-1, -1, D]),
        "value": ("FP32", [-1, -1, D]),
        "mask": ("BOOL", [-1, -1, -1]),
    }
    outputs = {t.name: (t.datatype, list(t.shape)) for t in meta.outputs}
    assert outputs == {
        "output": ("FP32", [-1, -1, D]),
        "attn_weights": ("FP32", [-1, -1, -1, -1]),  # [B, h, Lq, Lk], or the heads a request chose
        "attn_weights_mean": ("FP32", [-1, -1, -1]),
        "attn_weights_top_k_values": ("FP32", [-1, -1, -1, -1]),
        "attn_weights_top_k_indices": ("INT64", [-1, -1, -1, -1]),
        "attn_weights_entropy": ("FP32", [-1, -1, -1]),  # [B, h, Lq]: each head's query row summarised
        "attn_weights_sink": ("FP32", [-1, -1, -1]),
        "attn_weights_max": ("FP32", [-1, -1, -1]),
        "attn_weights_max_index": ("INT64", [-1, -1, -1]),
    }


def test_model_config_describes_the_model(stub):
    config = stub.ModelConfig(pb.ModelConfigRequest(name="mha")).config
    assert (config.name, config.platform, config.max_batch_size) == ("mha", "onnxruntime_onnx", 0)
    assert [(i.name, list(i.dims), i.optional) for i in config.input] == [
        ("query", [-1, -1, D], False),
        ("key", [-1, -1, D], True),
        ("value", [-1, -1, D], True),
        ("mask", [-1, -1, -1], True),
    ]
    assert [(o.name, list(o.dims)) for o in config.output] == [
        ("output", [-1, -1, D]),
        ("attn_weights", [-1, -1, -1, -1]),
        ("attn_weights_mean", [-1, -1, -1]),
        ("attn_weights_top_k_values", [-1, -1, -1, -1]),
        ("attn_weights_top_k_indices", [-1, -1, -1, -1]),
        *(
            (name, [-1, -1, -1])
            for name in ("attn_weights_entropy", "attn_weights_sink", "attn_weights_max", "attn_weights_max_index")
        ),
    ]
    # the limits a request (and a sequence, where the version serves them) is refused past
    limits = {name: config.parameters[name].string_value for name in ("max_q_len", "max_kv_len", "max_sequence_length")}
    assert limits == {"max_q_len": "64", "max_kv_len": "64", "max_sequence_length": "4096"}, limits  # the tests' server


@pytest.mark.parametrize(
    "call",
    [
        lambda s: s.ModelReady(pb.ModelReadyRequest(name="nope")),
        lambda s: s.ModelMetadata(pb.ModelMetadataRequest(name="nope")),
        lambda s: s.ModelConfig(pb.ModelConfigRequest(name="mha", version="7")),
        lambda s: s.ModelStatistics(pb.ModelStatisticsRequest(name="nope")),
    ],
)
def test_unknown_model_or_version_is_not_found(stub, call):
    with pytest.raises(grpc.RpcError) as error:
        call(stub)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_stream_infer_answers_in_order_and_survives_a_bad_request(stub, small_module):
    good = rand(1, 4, D, seed=14)
    bad = build_infer_request("mha", rand(1, 4, D + 1, seed=15))
    requests = [build_infer_request("mha", good, request_id="a"), bad, build_infer_request("mha", good, request_id="c")]
    responses = list(stub.ModelStreamInfer(iter(requests)))
    assert len(responses) == 3
    assert responses[0].infer_response.id == "a" and responses[2].infer_response.id == "c"
    assert "INVALID_ARGUMENT" in responses[1].error_message and "d_model" in responses[1].error_message
    out = np.frombuffer(responses[2].infer_response.raw_output_contents[0], dtype=np.float32).reshape(1, 4, D)
    np.testing.assert_allclose(out, eager(small_module, good)[0], atol=1e-5)


def open_stream(stub, request) -> tuple[queue.Queue, object]:
    """A ModelStreamInfer stream left open after its first request is answered: (where to send more, or None to end
    it; its answers)."""
    sending = queue.Queue()
    answers = stub.ModelStreamInfer(iter(sending.get, None), timeout=30)
    sending.put(request)
    assert not next(answers).error_message  # open, and answered
    return sending, answers


def answered_on_a_new_stream(stub, request) -> bool:
    answers = list(stub.ModelStreamInfer(iter([request]), timeout=10))
    return len(answers) == 1 and not answers[0].error_message


def test_inference_streams_past_their_cap_are_refused_until_one_ends(start_server, small_model_dir):
    """Each open stream may be receiving a request at any moment, so their number is what bounds them."""
    server = start_server(small_model_dir, "--warmup-runs", "0", "--max-inference-streams", "1")
    request = build_infer_request("mha", rand(1, 4, D, seed=16))
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        sending, first = open_stream(stub, request)
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ModelStreamInfer(iter([request]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-inference-streams is 1" in refused.value.details()
        sending.put(None)
        assert list(first) == []  # ended
        assert answered_on_a_new_stream(stub, request)


def test_one_clients_idle_streams_leave_room_for_other_clients(start_server, small_model_dir):
    """64 idle streams from one client locked every other client out of streaming."""
    server = start_server(small_model_dir, "--warmup-runs", "0", "--max-inference-streams", "4",
                          "--max-inference-streams-per-client", "2")  # fmt: skip
    request = build_infer_request("mha", rand(1, 4, D, seed=16))
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    with (
        grpc.insecure_channel(server.url, options=own_connection) as greedy,
        grpc.insecure_channel(server.url, options=own_connection) as other,
    ):
        greedy_stub, other_stub = pb_grpc.GRPCInferenceServiceStub(greedy), pb_grpc.GRPCInferenceServiceStub(other)
        held = [open_stream(greedy_stub, request) for _ in range(2)]  # open, answered, then idle
        with pytest.raises(grpc.RpcError) as refused:
            list(greedy_stub.ModelStreamInfer(iter([request]), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-inference-streams-per-client" in refused.value.details()
        assert answered_on_a_new_stream(other_stub, request)  # another client streams
        for sending, _ in held:
            sending.put(None)


def test_an_idle_stream_is_ended_and_its_place_freed(start_server, small_model_dir):
    server = start_server(small_model_dir, "--warmup-runs", "0", "--max-inference-streams", "1",
                          "--stream-idle-timeout-s", "0.5")  # fmt: skip
    request = build_infer_request("mha", rand(1, 4, D, seed=16))
    with grpc.insecure_channel(server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        sending, idle = open_stream(stub, request)
        with pytest.raises(grpc.RpcError) as ended:  # no second request: ended by the server
            next(idle)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "--stream-idle-timeout-s" in ended.value.details()
        assert answered_on_a_new_stream(stub, request)  # its place is free
        sending.put(None)


class Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(f"{code.name}: {details}")
        self.code = code


class RecordingContext:
    """The part of a grpc.aio servicer context the inference handlers use."""

    def time_remaining(self):
        return None

    def peer(self):
        return "ipv4:127.0.0.1:50000"

    async def abort(self, code, details="", trailing_metadata=()):  # grpc.aio's signature
        raise Aborted(code, details)

    def __init__(self):
        self.written = []  # answers the handler wrote, taken at once

    async def write(self, answer):
        self.written.append(answer)

    def add_done_callback(self, callback):
        callback(self)  # the answer is taken at once


def test_a_failing_model_run_answers_internal_and_the_next_request_is_served(small_model_dir):
    from mhaserve.server.config import ServerSettings
    from mhaserve.server.dataplane import DataPlane
    from mhaserve.server.grpc.handlers import ReceivedMessage
    from mhaserve.server.grpc.servicer import InferenceServicer

    async def scenario():
        dataplane = DataPlane(ServerSettings(intra_op_threads=1, warmup_runs=0), small_model_dir)
        await dataplane.start()
        servicer = InferenceServicer(dataplane)
        wire = build_infer_request("mha", rand(1, 4, D, seed=18), request_id="good").SerializeToString()

        def good():  # as gRPC hands the servicer an inference request
            return ReceivedMessage(wire, pb.ModelInferRequest, dataplane.off_loop_if_large)

        batcher = dataplane.resolve("mha", "").batched.batcher
        working_run = batcher._run_model

        def failing_run(*args):
            raise RuntimeError("ONNX Runtime gave up")

        batcher._run_model = failing_run
        with pytest.raises(Aborted, match="INTERNAL: inference failed: RuntimeError: ONNX Runtime gave up") as error:
            await servicer.ModelInfer(good(), RecordingContext())
        stream = RecordingContext()
        await servicer.ModelStreamInfer(_aiter([good()]), stream)
        streamed = stream.written
        batcher._run_model = working_run
        answer = pb.ModelInferResponse.FromString(await servicer.ModelInfer(good(), RecordingContext()))
        dataplane.shutdown()
        return error.value, streamed, answer, dataplane.accounting.outcomes

    error, streamed, answer, outcomes = asyncio.run(scenario())
    assert error.code == grpc.StatusCode.INTERNAL
    assert streamed[0].error_message == "INTERNAL: inference failed: RuntimeError: ONNX Runtime gave up"
    assert answer.id == "good" and len(answer.raw_output_contents) == 2
    assert outcomes == {"INTERNAL": 2, "OK": 1}  # the statistics and metrics name the failure as the client saw it


async def _aiter(items):
    for item in items:
        yield item


def test_statistics_count_inferences(stub, client):
    def stats():
        return stub.ModelStatistics(pb.ModelStatisticsRequest(name="mha")).model_stats[0]

    before = stats()
    client.infer(rand(3, 2, D, seed=16))
    with pytest.raises(grpc.RpcError):
        client.infer(rand(1, 2, D + 1, seed=17))
    after = stats()
    assert after.inference_count - before.inference_count == 3
    assert after.execution_count - before.execution_count == 1
    assert after.inference_stats.success.count - before.inference_stats.success.count == 1
    assert after.inference_stats.fail.count - before.inference_stats.fail.count == 1
    assert after.last_inference > 0


def test_reflection_lists_and_describes_the_services(server):
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(server.url) as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        described = DescriptorPool(database)  # what grpcurl's "describe" does: each file fetched by symbol
        infer = described.FindServiceByName("inference.GRPCInferenceService").methods_by_name["ModelInfer"]
        check = described.FindServiceByName("grpc.health.v1.Health").methods_by_name["Check"]
    assert {"inference.GRPCInferenceService", "grpc.health.v1.Health"} <= services
    assert infer.input_type.fields_by_name["raw_input_contents"].number == 7
    assert check.output_type.full_name == "grpc.health.v1.HealthCheckResponse"


def test_health_service_reports_serving(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(server.url) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "inference.GRPCInferenceService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_the_serving_process_never_loads_torch(server):
    maps = open(f"/proc/{server.proc.pid}/maps").read()
    assert "onnxruntime" in maps  # the check can see what the process loaded
    assert "libtorch" not in maps and "/torch/" not in maps


def test_start_up_line_names_model_provider_threads_and_address(server):
    line = next(line for line in server.lines if "serving model=" in line)
    for part in ("model=mha", f"d_model={D}", "opset=18", "provider=", "intra_op_threads=", f"address={server.url}"):
        assert part in line


def thread_nice_values(pid: int) -> dict[int, int]:
    """Each thread's nice value, from /proc (field 19 of stat; the name before it may hold spaces)."""
    values = {}
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        after_name = stat.read_text().rsplit(")", 1)[1].split()
        values[int(stat.parent.name)] = int(after_name[16])
    return values


def test_inference_threads_run_below_the_grpc_thread(server):
    # So that when model runs fill every core, the thread that receives, refuses and answers still runs.
    line = next(line for line in server.lines if "serving model=" in line)
    intra_op_threads = int(re.search(r"intra_op_threads=(\d+)", line).group(1))
    nice = thread_nice_values(server.proc.pid)
    assert nice[server.proc.pid] == 0  # the main thread: the event loop
    # The worker that calls ONNX Runtime and the threads ONNX Runtime made from it (intra_op_threads in all).
    assert sum(value == 10 for value in nice.values()) >= intra_op_threads, nice


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/PID/stat")
def test_with_intra_op_spin_ms_0_a_server_of_sparse_traffic_is_idle_between_requests(
    start_server_process, small_model_dir, small_module
):
    """ONNX Runtime's threads spin for the next run for tens of milliseconds after each, a core's worth of CPU per
    request a tenth of a second apart (BENCHMARKS.md, "Server settings that change speed"); told not to, they
    sleep once a run ends, and the server answers the same."""
    from mhaserve.loadtest.checked_load import process_cpu_seconds

    server = start_server_process(
        small_model_dir, *TEST_SERVER_ARGS, "--intra-op-threads", "2", "--intra-op-spin-ms", "0"
    )
    query = rand(1, 16, D, seed=3)
    with Client(server.url) as client:
        for _ in range(3):
            client.infer(query)
        before = process_cpu_seconds(server.proc.pid)
        for _ in range(10):
            time.sleep(0.1)
            result = client.infer(query)
        cpu_ms_per_request = (process_cpu_seconds(server.proc.pid) - before) / 10 * 1000
    assert cpu_ms_per_request < 15, f"{cpu_ms_per_request:.1f} ms of CPU per request a tenth of a second apart"
    np.testing.assert_allclose(result.output, eager(small_module, query)[0], atol=1e-5)


def test_device_auto_without_cuda_serves_on_cpu_with_one_warning_only_where_a_gpu_is_present(server):
    import onnxruntime as ort

    from mhaserve.server.session import gpu_present

    line = next(line for line in server.lines if "serving model=" in line)
    if "provider=CUDAExecutionProvider" in line:
        pytest.skip("CUDA is usable here")
    assert "provider=CPUExecutionProvider" in line
    warnings = sum("CUDA is not usable" in line for line in server.lines)
    # A machine with no GPU at all hears nothing of CUDA: the serving line's provider says it all.
    expected = 1 if gpu_present() and "CUDAExecutionProvider" in ort.get_available_providers() else 0
    assert warnings == expected, server.log


def test_device_cuda_refuses_to_start_without_cuda(small_model_dir):
    import onnxruntime as ort

    from mhaserve.server.app import StartFailed
    from tests.support.in_process import InProcessServer

    server = InProcessServer(small_model_dir, "--device", "cuda")
    try:
        server.start()
    except StartFailed as failure:
        refusal = failure.reason
    else:
        server.stop()
        pytest.skip("CUDA is usable here")
    assert refusal.startswith("cannot serve: --device cuda"), refusal
    if "CUDAExecutionProvider" in ort.get_available_providers():
        # The refusal names what is missing: a library (pip's CUDA wheels, or the driver) or a GPU.
        assert "the CUDA provider did not load: lib" in refusal or "no CUDA session" in refusal
    else:
        assert "no CUDA provider" in refusal


def test_a_folder_whose_validation_failed_is_refused_with_one_line_and_exit_code_3(
    start_server_process, tmp_path, small_model_dir
):
    import json
    import shutil

    folder = tmp_path / "invalid"
    shutil.copytree(small_model_dir, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["valid"] = False
    (folder / "manifest.json").write_text(json.dumps(manifest))
    process = start_server_process(folder, wait=False)
    assert process.wait_exit(60) == 3, process.log
    assert "Traceback" not in process.log
    refusals = [line for line in process.log.splitlines() if "cannot serve" in line]
    assert len(refusals) == 1 and "failed validation" in refusals[0], process.log


def test_infer_cli_prints_shapes_saves_npz_and_draws_a_heatmap(server, small_module, tmp_path):
    import subprocess
    import sys

    from matplotlib.image import imread

    saved, png = tmp_path / "out.npz", tmp_path / "head1.png"
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url, "--batch", "2", "--q-len", "5",
         "--kv-len", "9", "--repeat", "3", "--save", str(saved), "--heatmap", str(png), "--head", "1", "--item", "1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"output: [2, 5, {D}]  attn_weights: [2, {H}, 5, 9]" in done.stdout
    assert "latency ms over 3 calls" in done.stdout and "(item 1, head 1)" in done.stdout
    data = np.load(saved)
    want_out, want_attn = eager(small_module, data["query"], data["key"], data["value"])
    np.testing.assert_allclose(data["output"], want_out, atol=1e-5)
    np.testing.assert_allclose(data["attn_weights"], want_attn, atol=1e-5)
    assert imread(png).ndim == 3  # a PNG that matplotlib itself reads back, with colour channels


def test_infer_cli_asks_for_the_mean_over_heads_alone(server, small_module, tmp_path):
    import subprocess
    import sys

    saved, png = tmp_path / "mean.npz", tmp_path / "mean.png"
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url, "--q-len", "6", "--no-weights",
         "--save", str(saved), "--heatmap", str(png), "--head", "mean"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"output: [1, 6, {D}]  attn_weights_mean: [1, 6, 6]" in done.stdout and png.stat().st_size > 0
    data = np.load(saved)
    assert "attn_weights" not in data  # only the mean travelled
    _, want_attn = eager(small_module, data["query"])
    np.testing.assert_allclose(data["attn_weights_mean"], want_attn.mean(axis=1), rtol=0, atol=1e-6)

    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url, "--heatmap", str(png), "--head", str(H)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and f"--head {H}: the model has heads 0..{H - 1}" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--head", "1"], "--head chooses the head --heatmap draws: give --heatmap FILE.png too"),  # was ignored
        (["--batch", "2", "--summaries", "--item", "2"], "--item 2: the batch has items 0..1"),  # item 0's, silently
    ],
)
def test_infer_cli_refuses_a_choice_it_would_not_honour_before_calling(server, stub, args, said):
    def inferences() -> int:
        return stub.ModelStatistics(pb.ModelStatisticsRequest(name="mha")).model_stats[0].inference_count

    before = inferences()
    done = subprocess.run([sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url, *args],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip() == f"mhaserve infer: error: {said}", done.stderr
    assert inferences() == before


@pytest.mark.parametrize("content", [b"", b"not numpy", b"PK\x03\x04 not a zip"], ids=["empty", "garbage", "zip"])
def test_infer_cli_says_in_one_line_that_an_input_file_is_unreadable(server, tmp_path, content):
    bad = tmp_path / "query.npy"
    bad.write_bytes(content)
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url, "--query", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and f"--query {bad}: not a readable .npy" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_infer_cli_takes_an_input_from_an_npz_by_its_name_and_replays_a_saved_call(server, tmp_path):
    query, mask = rand(1, 5, D, seed=3), np.array([[True, True, True, False, False]])
    np.savez(tmp_path / "in.npz", query=query, mask=mask)
    infer = [sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url]
    for source, target in (("in.npz", "first.npz"), ("first.npz", "again.npz")):  # --save's file read back in
        inputs = ["--query", str(tmp_path / source), "--mask", str(tmp_path / source)]
        done = subprocess.run([*infer, *inputs, "--save", str(tmp_path / target)], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
    with np.load(tmp_path / "first.npz") as first, np.load(tmp_path / "again.npz") as again:
        np.testing.assert_array_equal(first["query"], query)
        np.testing.assert_array_equal(again["mask"], mask)
        np.testing.assert_array_equal(again["output"], first["output"])

    np.savez(tmp_path / "two.npz", a=query, b=query)
    done = subprocess.run([*infer, "--query", str(tmp_path / "two.npz")], capture_output=True, text=True, timeout=60)
    said = f"mhaserve infer: error: --query {tmp_path / 'two.npz'}: an .npz of several arrays (a, b) and none named"
    assert done.returncode == 2 and done.stderr.startswith(said), done.stderr


def test_infer_cli_reports_a_refusal_clearly(server):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "infer", "--url", server.url, "--q-len", "65"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "RESOURCE_EXHAUSTED" in done.stderr and "max_q_len=64" in done.stderr


def test_health_command_says_serving_or_fails(server):
    import subprocess
    import sys

    from mhaserve.server.process import free_port

    command = [sys.executable, "-m", "mhaserve.cli", "health", "--url"]
    serving = subprocess.run([*command, server.url], capture_output=True, text=True, timeout=60)
    assert serving.returncode == 0 and "SERVING" in serving.stdout
    nobody = subprocess.run([*command, f"127.0.0.1:{free_port()}", "--timeout", "1"], capture_output=True, text=True)
    assert nobody.returncode == 1 and "UNAVAILABLE" in nobody.stderr
