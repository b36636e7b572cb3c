"""Triton's system shared-memory extension: tritonclient (grpc and http, with tritonclient.utils.shared_memory)
unchanged against a real server, answers bit-equal to the socket path; every bad registration and use refused
with a status naming what is wrong; a region truncated under the server; unregistering under load."""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from multiprocessing import shared_memory

import grpc
import numpy as np
import pytest

from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support import CLIENT_SCRIPTS, SMALL_D_MODEL, TEST_SERVER_ARGS, rand

D = SMALL_D_MODEL
TOKEN = "shm-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SHM_ARGS = ("--allow-client-shm", "true")


@pytest.fixture
def region(request):
    """A POSIX shared-memory object of the given size, removed when the test ends: ``region(size) -> (key, shm)``."""
    made = []

    def make(size: int):
        key = f"mhaserve_test_{os.getpid()}_{len(made)}"
        shm = shared_memory.SharedMemory(key, create=True, size=size)
        made.append(shm)
        return "/" + key, shm

    yield make
    for shm in made:
        try:
            shm.close()
        except BufferError:  # a failed test's frames still view it: the mapping goes with them, the name now
            pass
        try:
            shm.unlink()
        except FileNotFoundError:
            pass


def http(server, method: str, path: str, document=None, headers=AUTH) -> tuple[int, dict]:
    body = None if document is None else json.dumps(document).encode()
    request = urllib.request.Request(server.http_url + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            raw = response.read()
            return response.status, json.loads(raw) if raw else {}
    except urllib.error.HTTPError as error:
        raw = error.read()
        return error.code, json.loads(raw) if raw else {}


def register(server, name: str, key, byte_size, offset=0, headers=AUTH):
    return http(
        server, "POST", f"/v2/systemsharedmemory/region/{name}/register",
        {"key": key, "offset": offset, "byte_size": byte_size}, headers,
    )  # fmt: skip


def shm_input(name, shape, region, byte_size, offset=0, datatype="FP32"):
    parameters = {"shared_memory_region": region, "shared_memory_byte_size": byte_size, "shared_memory_offset": offset}
    return {"name": name, "shape": list(shape), "datatype": datatype, "parameters": parameters}


def shm_output(name, region, byte_size, offset=0):
    parameters = {"shared_memory_region": region, "shared_memory_byte_size": byte_size, "shared_memory_offset": offset}
    return {"name": name, "parameters": parameters}


def infer(server, inputs, outputs=(), headers=AUTH):
    return http(server, "POST", "/v2/models/mha/infer", {"inputs": inputs, "outputs": list(outputs)}, headers)


def socket_answer(server, query) -> np.ndarray:
    status, answer = infer(server, [{"name": "query", "shape": list(query.shape), "datatype": "FP32",
                                     "data": query.ravel().tolist()}], [{"name": "output"}])  # fmt: skip
    assert status == 200, answer
    return np.asarray(answer["outputs"][0]["data"], dtype=np.float32).reshape(query.shape)


@pytest.fixture(scope="module")
def shm_server(small_model_dir, tmp_path_factory):
    from tests.support.in_process import InProcessServer

    token_file = tmp_path_factory.mktemp("shm-token") / "token"
    token_file.write_text(TOKEN)
    args = (*TEST_SERVER_ARGS, *SHM_ARGS, "--client-shm-max-regions", "6", "--client-shm-max-bytes", str(64 << 20))
    with InProcessServer(small_model_dir, *args, "--auth-token-file", str(token_file)) as process:
        yield process


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tritonclient_inputs_and_outputs_in_shared_memory_equal_the_socket_path(shm_server, tmp_path, protocol):
    rng = np.random.default_rng(5)
    cases = {
        "self": {"query": rng.standard_normal((2, 7, D), dtype=np.float32)},
        "cross": {
            "query": rng.standard_normal((2, 3, D), dtype=np.float32),
            "key": rng.standard_normal((2, 5, D), dtype=np.float32),
            "value": rng.standard_normal((2, 5, D), dtype=np.float32),
            "mask": np.array([[1, 1, 0, 0, 1], [1, 1, 1, 1, 1]], dtype=bool),
        },
    }
    path_in, path_out = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(path_in, **{f"{case}_{name}": a for case, arrays in cases.items() for name, a in arrays.items()})
    url = shm_server.url if protocol == "grpc" else shm_server.http_url.removeprefix("http://")
    done = subprocess.run(
        [sys.executable, str(CLIENT_SCRIPTS / "triton_shm.py"), protocol, url, str(path_in), str(path_out)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TRITON_TOKEN": TOKEN},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = np.load(path_out)
    for case in cases:
        for output in ("output", "attn_weights"):
            from_shm, from_socket = results[f"{case}_{output}_shm"], results[f"{case}_{output}_socket"]
            assert from_shm.shape == from_socket.shape and np.array_equal(from_shm, from_socket), (case, output)
    listed = json.loads(str(results["status"]))["cross"]
    regions = listed["regions"].values() if protocol == "grpc" else listed
    assert sorted(r["name"] for r in regions) == ["cross_in", "cross_out"]
    assert json.loads(str(results["status_after"])) in ({}, [])


def test_the_extension_is_off_unless_allowed_and_listed_only_when_on(server, shm_server):
    status, answer = register(server, "r", "/anything", 16, headers={})
    assert status == 400 and "--allow-client-shm true" in answer["error"]
    query = rand(1, 2, D)
    status, answer = infer(server, [shm_input("query", query.shape, "r", query.nbytes)], headers={})
    assert status == 400 and "--allow-client-shm" in answer["error"]
    assert "system_shared_memory" not in http(server, "GET", "/v2", headers={})[1]["extensions"]
    assert "system_shared_memory" in http(shm_server, "GET", "/v2")[1]["extensions"]


def test_bad_registrations_are_refused_naming_what_is_wrong(shm_server, region, tmp_path):
    key, _ = region(4096)
    link = f"/dev/shm/mhaserve_test_link_{os.getpid()}"
    os.symlink(tmp_path / "elsewhere", link)
    (tmp_path / "elsewhere").write_bytes(b"x" * 4096)
    try:
        refused = {
            "path": register(shm_server, "a", "/../../etc/hostname", 16),
            "slash": register(shm_server, "a", "/tmp/file", 16),
            "link": register(shm_server, "a", "/" + os.path.basename(link), 16),
            "missing": register(shm_server, "a", "/mhaserve_test_no_such_key", 16),
            "too_long": register(shm_server, "a", key, 4096, offset=1),
            "empty": register(shm_server, "a", key, 0),
            "negative": register(shm_server, "a", key, -1),
            "huge": register(shm_server, "a", key, 2**64),
            "key_type": register(shm_server, "a", 7, 16),
        }
    finally:
        os.unlink(link)
    assert {case: status for case, (status, _) in refused.items()} == dict.fromkeys(refused, 400)
    messages = {case: answer["error"] for case, (_, answer) in refused.items()}
    assert "not a POSIX shared-memory name" in messages["path"] and "not a POSIX" in messages["slash"]
    assert "cannot open key" in messages["link"]
    assert "no shared-memory object with key '/mhaserve_test_no_such_key'" in messages["missing"]
    assert "offset 1 + byte_size 4096 = 4097 runs past the end" in messages["too_long"]
    assert "byte_size 0" in messages["empty"] and "byte_size -1" in messages["negative"]
    assert "2^63-1" in messages["huge"] and "key 7" in messages["key_type"]
    assert http(shm_server, "GET", "/v2/systemsharedmemory/status")[1] == []

    assert register(shm_server, "taken", key, 16)[0] == 200
    status, answer = register(shm_server, "taken", key, 16)
    assert status == 409 and "'taken' is already registered" in answer["error"]
    assert register(shm_server, "other", key, 16, headers={})[0] == 401
    status, answer = register(shm_server, "big", key, 4096)
    assert status == 200, answer  # 16 + 4096 bytes registered: within 64 MiB
    for number in range(4):
        assert register(shm_server, f"more{number}", key, 16)[0] == 200
    status, answer = register(shm_server, "seventh", key, 16)
    assert status == 429 and "--client-shm-max-regions=6" in answer["error"]
    assert http(shm_server, "POST", "/v2/systemsharedmemory/unregister", headers={})[0] == 401
    assert http(shm_server, "POST", "/v2/systemsharedmemory/unregister")[0] == 200
    assert http(shm_server, "GET", "/v2/systemsharedmemory/region/taken/status")[0] == 404
    assert http(shm_server, "POST", "/v2/systemsharedmemory/region/never/unregister")[0] == 200  # as Triton
    large_key, _ = region(65 << 20)  # sparse: nothing is allocated
    status, answer = register(shm_server, "large", large_key, 65 << 20)
    assert status == 429 and f"--client-shm-max-bytes={64 << 20}" in answer["error"]

    with grpc.insecure_channel(shm_server.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("authorization", f"Bearer {TOKEN}"),)
        with pytest.raises(grpc.RpcError) as refusal:
            stub.SystemSharedMemoryRegister(pb.SystemSharedMemoryRegisterRequest(name="a", key="/x/y", byte_size=1),
                                            metadata=metadata)  # fmt: skip
        assert refusal.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "/x/y" in refusal.value.details()
        with pytest.raises(grpc.RpcError) as refusal:
            stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest())
        assert refusal.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refusal:
            stub.CudaSharedMemoryRegister(pb.CudaSharedMemoryRegisterRequest(name="c", byte_size=4), metadata=metadata)
        assert (
            refusal.value.code() == grpc.StatusCode.UNIMPLEMENTED and "system shared memory" in refusal.value.details()
        )
    status, answer = http(shm_server, "POST", "/v2/cudasharedmemory/region/c/register", {"raw_handle": {"b64": ""}})
    assert status == 501 and "CUDA shared memory is not offered" in answer["error"]
    assert http(shm_server, "GET", "/v2/cudasharedmemory/status") == (200, [])


def test_bad_uses_are_refused_naming_the_tensor_and_the_region(shm_server, region):
    query = rand(1, 4, D, seed=2)
    key, shm = region(query.nbytes + 64)
    shm.buf[: query.nbytes] = query.tobytes()
    assert register(shm_server, "uses", key, query.nbytes + 64)[0] == 200
    try:
        size = query.nbytes
        cases = {
            "unknown": ([shm_input("query", query.shape, "nope", size)], []),
            "past_window": ([shm_input("query", query.shape, "uses", size, offset=65)], []),
            "wrong_size": ([shm_input("query", query.shape, "uses", size - 4)], []),
            "both": ([{**shm_input("query", query.shape, "uses", size), "data": [0.0]}], []),
            "half": (
                [
                    {
                        "name": "query",
                        "shape": [1, 4, D],
                        "datatype": "FP32",
                        "parameters": {"shared_memory_byte_size": size},
                    }
                ],
                [],
            ),  # fmt: skip
            "output_small": ([shm_input("query", query.shape, "uses", size)], [shm_output("output", "uses", 8)]),
            "output_past": ([shm_input("query", query.shape, "uses", size)], [shm_output("output", "uses", size, 65)]),
        }
        answers = {case: infer(shm_server, *request) for case, request in cases.items()}
        assert {case: status for case, (status, _) in answers.items()} == dict.fromkeys(cases, 400), answers
        messages = {case: answer["error"] for case, (_, answer) in answers.items()}
        assert "input 'query': unknown shared memory region 'nope'" in messages["unknown"]
        assert (
            f"offset 65 + byte size {size} = {size + 65} runs past the end of region 'uses'" in messages["past_window"]
        )
        assert f"shared_memory_byte_size {size - 4}, expected {size}" in messages["wrong_size"]
        assert "input 'query': has data and a shared memory region" in messages["both"]
        assert "'shared_memory_byte_size' without 'shared_memory_region'" in messages["half"]
        assert (
            f"output 'output': {size} bytes to write, but its shared memory byte size is 8" in messages["output_small"]
        )
        assert "output 'output': shared memory offset 65" in messages["output_past"]
        # And a good one beside them: input and output in the same region, at different offsets.
        status, answer = infer(shm_server, [shm_input("query", query.shape, "uses", size)],
                               [shm_output("output", "uses", size, 0)])  # fmt: skip
        assert status == 200 and "data" not in answer["outputs"][0], answer
        written = np.frombuffer(shm.buf[:size], dtype=np.float32).reshape(query.shape)
        assert np.array_equal(written, socket_answer(shm_server, query))
    finally:
        http(shm_server, "POST", "/v2/systemsharedmemory/region/uses/unregister")


def test_a_region_truncated_under_the_server_is_refused_and_the_server_keeps_serving(shm_server, region):
    query = rand(2, 8, D, seed=3)
    key, shm = region(2 * query.nbytes)
    shm.buf[: query.nbytes] = query.tobytes()
    assert register(shm_server, "shrinks", key, 2 * query.nbytes)[0] == 200
    try:
        os.truncate(f"/dev/shm/{key[1:]}", query.nbytes // 2)  # the client shrinks its object
        status, answer = infer(shm_server, [shm_input("query", query.shape, "shrinks", query.nbytes)])
        assert status == 400 and "was truncated after it was registered" in answer["error"], answer
        os.truncate(f"/dev/shm/{key[1:]}", query.nbytes)  # inputs fit again; the output window does not
        output = [shm_output("output", "shrinks", query.nbytes, offset=query.nbytes)]
        status, answer = infer(shm_server, [shm_input("query", query.shape, "shrinks", query.nbytes)], output)
        assert status == 400 and "output 'output'" in answer["error"] and "truncated" in answer["error"], answer
        assert os.stat(f"/dev/shm/{key[1:]}").st_size == query.nbytes  # not grown back by the server
        assert shm_server.alive
        assert socket_answer(shm_server, query).shape == query.shape
    finally:
        http(shm_server, "POST", "/v2/systemsharedmemory/region/shrinks/unregister")


def open_files(pid: int) -> list[str]:
    """What the process's descriptors point at (one closed while they are read is left out)."""
    links = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return links


def test_unregistering_under_load_loses_nothing_and_frees_the_region_once_its_requests_end(
    start_server, small_model_dir, region, tmp_path
):
    # Requests wait 30 ms in the batcher for others (batches of up to 32 rows, 8 callers), so the unregister is read
    # while some, their region resolved, are still queued; each caller sends again as soon as it is answered.
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    shm_server = start_server(small_model_dir, *TEST_SERVER_ARGS, *SHM_ARGS, "--auth-token-file", str(token_file),
                              "--max-batch-size", "32", "--max-queue-delay-us", "30000")  # fmt: skip
    callers, length = 8, 64
    queries = [rand(1, length, D, seed=100 + n) for n in range(callers)]
    size = queries[0].nbytes
    expected = [socket_answer(shm_server, query) for query in queries]
    # Where none was answered after the unregister anyway, the load is sent again over a region of its own.
    for attempt in range(5):
        name = f"busy{attempt}"
        key, shm = region(2 * callers * size)
        for n, query in enumerate(queries):
            shm.buf[n * size : (n + 1) * size] = query.tobytes()
        before = [link for link in open_files(shm_server.pid) if key[1:] in link]  # the test's own, in process
        assert register(shm_server, name, key, 2 * callers * size)[0] == 200
        answered = threading.Event()

        def caller(n: int, name=name, answered=answered, shm=shm) -> list:
            answers = []  # (status, body, when answered, its output as written)
            while True:
                status, body = infer(shm_server, [shm_input("query", queries[n].shape, name, size, offset=n * size)],
                                     [shm_output("output", name, size, offset=(callers + n) * size)])  # fmt: skip
                written = np.frombuffer(shm.buf[(callers + n) * size : (callers + n + 1) * size], np.float32).copy()
                answers.append((status, body, time.monotonic(), written))
                answered.set()
                if status != 200:
                    return answers

        with concurrent.futures.ThreadPoolExecutor(callers) as pool:
            futures = [pool.submit(caller, n) for n in range(callers)]
            answered.wait(60)
            time.sleep(0.05)  # every caller under way
            assert http(shm_server, "POST", f"/v2/systemsharedmemory/region/{name}/unregister")[0] == 200
            unregistered_at = time.monotonic()
            answers = [f.result(timeout=60) for f in futures]
        for n, own in enumerate(answers):
            *whole, (status, body, _, _) = own
            assert (status, body) == (400, {"error": f"input 'query': unknown shared memory region '{name}'; "
                                                     "register it first"}), own[-1][:2]  # fmt: skip
            for status, _, _, written in whole:  # every request accepted was answered whole, into the region
                assert status == 200 and np.array_equal(written.reshape(queries[n].shape), expected[n]), n
        links = open_files(shm_server.pid)
        assert [link for link in links if key[1:] in link] == before, "the region is still open after its requests"
        if any(when > unregistered_at for own in answers for status, _, when, _ in own if status == 200):
            return  # a request still running at the unregister was answered whole
    pytest.fail("in 5 tries, no request was still running when the unregister was read")


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_the_python_clients_send_tensors_through_shared_memory_and_answer_as_over_the_socket(shm_server, protocol):
    from mhaserve.client import Client, HttpClient, WeightsOptions

    if protocol == "grpc":
        client = Client(shm_server.url, token=TOKEN)
    else:
        client = HttpClient(shm_server.http_url.removeprefix("http://"), token=TOKEN)
    query, key = rand(2, 5, D, seed=7), rand(2, 9, D, seed=8)
    mask = np.array([[1] * 9, [1] * 4 + [0] * 5], dtype=bool)
    top_k = WeightsOptions(heads=(0, 2), top_k=3)
    with client, client.shared_memory() as regions:
        for kwargs in ({}, {"key": key, "value": key, "mask": mask}, {"weights": top_k, "attn_weights_mean": True}):
            over_socket = client.infer(query, **kwargs)
            through_memory = client.infer(query, shared_memory=regions, **kwargs)
            assert through_memory.outputs.keys() == over_socket.outputs.keys()
            for name, array in over_socket.outputs.items():
                assert np.array_equal(through_memory.outputs[name], array), (kwargs, name)
        longer = rand(1, 40, D, seed=9)  # more than the regions hold: they grow
        assert np.array_equal(client.infer(longer, shared_memory=regions).output, client.infer(longer).output)
        assert len(http(shm_server, "GET", "/v2/systemsharedmemory/status")[1]) == 2
    assert http(shm_server, "GET", "/v2/systemsharedmemory/status")[1] == []
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(regions.name)]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_a_region_the_server_refuses_is_not_left_on_the_host(server, protocol):
    from mhaserve.client import Client, HttpClient, RequestFailed

    client = Client(server.url) if protocol == "grpc" else HttpClient(server.http_url.removeprefix("http://"))
    with client, pytest.raises(RequestFailed) as refused:
        regions = client.shared_memory()  # and never closed: nothing registered, nothing to close
        client.infer(rand(1, 3, D, seed=1), shared_memory=regions)
    assert "--allow-client-shm true" in str(refused.value)
    assert not [name for name in os.listdir("/dev/shm") if name.startswith(regions.name)]
    regions.close()  # closes nothing, refuses nothing


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_mhaserve_infer_takes_shared_memory_and_says_in_one_line_when_the_server_refuses_it(
    shm_server, server, tmp_path, protocol
):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)

    def infer_cli(target, *args):
        url = target.url if protocol == "grpc" else target.http_url.removeprefix("http://")
        command = [sys.executable, "-m", "mhaserve.cli", "infer", "--protocol", protocol, "--url", url, "--q-len", "12",
                   "--save", str(tmp_path / f"{len(args)}.npz"), *args]  # fmt: skip
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    socket = infer_cli(shm_server, "--token-file", str(token_file))
    through_memory = infer_cli(shm_server, "--token-file", str(token_file), "--shared-memory", "system")
    assert socket.returncode == 0 and through_memory.returncode == 0, socket.stderr + through_memory.stderr
    a, b = np.load(tmp_path / "2.npz"), np.load(tmp_path / "4.npz")
    assert all(np.array_equal(a[name], b[name]) for name in ("output", "attn_weights"))
    refused = infer_cli(server, "--shared-memory", "system")
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "--allow-client-shm true" in refused.stderr


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_mhaserve_bench_loads_the_server_through_shared_memory_and_cleans_up(shm_server, tmp_path, protocol):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    url = shm_server.url if protocol == "grpc" else shm_server.http_url.removeprefix("http://")
    command = [sys.executable, "-m", "mhaserve.cli", "bench", "--protocol", protocol, "--url", url, "--token-file",
               str(token_file), "--shared-memory", "system", "--concurrency", "3", "--duration", "1", "--warmup",
               "0.5", "--processes", "1", "--lengths", "4..12", "--json", str(tmp_path / "bench.json")]  # fmt: skip
    before = {name for name in os.listdir("/dev/shm") if name.startswith("mhaserve-")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (row,) = json.loads((tmp_path / "bench.json").read_text())["points"]
    assert row["shared_memory"] == "system" and row["requests"] > 0 and row["errors"] == 0, row
    assert http(shm_server, "GET", "/v2/systemsharedmemory/status")[1] == []
    assert {name for name in os.listdir("/dev/shm") if name.startswith("mhaserve-")} <= before


@pytest.fixture
def far_host():
    """Another host: a network namespace of this test's own, joined by a veth pair (skipped where none can be
    made)."""
    from tests.support.netns import other_host, why_no_namespace

    if (why := why_no_namespace()) is not None:
        pytest.skip(why)
    made = other_host()
    try:
        host = made.__enter__()
    except RuntimeError as error:
        pytest.skip(f"no network namespace here: {error}")
    yield host
    made.__exit__(None, None, None)


def test_shared_memory_is_refused_to_a_caller_on_another_host_whatever_it_asks(small_model_dir, region, far_host):
    from tests.support.in_process import InProcessServer

    key, _ = region(4096)
    args = (*TEST_SERVER_ARGS, *SHM_ARGS, "--host", "0.0.0.0")
    with InProcessServer(small_model_dir, *args) as server:
        http_port = server.http_url.rsplit(":", 1)[1]
        assert "shared memory is refused (PERMISSION_DENIED, HTTP 403) to every caller not on loopback" in server.log
        # From loopback the same server registers a region: the one the far requests then name.
        assert register(server, "near", key, 4096, headers={})[0] == 200
        done = far_host.run(
            sys.executable, str(CLIENT_SCRIPTS / "shm_from_afar.py"), f"{far_host.server_address}:{server.port}",
            f"http://{far_host.server_address}:{http_port}", str(D), key,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        answers = json.loads(done.stdout)
        # Untouched by the far calls, and still served to loopback.
        assert http(server, "GET", "/v2/systemsharedmemory/status", headers={}) == (
            200,
            [{"name": "near", "key": key, "offset": 0, "byte_size": 4096}],
        )
    assert answers.pop("grpc plain infer") == "OK", answers  # the other host reaches the server
    for call in ("grpc register", "grpc status", "grpc unregister", "grpc infer into shared memory"):
        assert answers[call] == "PERMISSION_DENIED", (call, answers)
        assert f"came from ipv4:{far_host.address}" in answers[f"{call} message"], answers
    for call in ("http register", "http status", "http unregister", "http infer into shared memory"):
        assert answers[call] == 403, (call, answers)
        assert "only for clients on the server's own host" in answers[f"{call} message"], answers


def test_a_region_belongs_to_the_caller_that_registered_it(small_model_dir, region, tmp_path):
    from tests.support.in_process import InProcessServer

    (tmp_path / "tokens").write_text("alice alice-token\nbob bob-token\n")
    alice, bob = ({"Authorization": f"Bearer {name}-token"} for name in ("alice", "bob"))
    query = rand(1, 3, D, seed=21)
    key, shm = region(2 * query.nbytes)
    shm.buf[: query.nbytes] = query.tobytes()
    inputs = [shm_input("query", query.shape, "mine", query.nbytes)]
    outputs = [shm_output("output", "mine", query.nbytes, offset=query.nbytes)]
    with InProcessServer(small_model_dir, *TEST_SERVER_ARGS, *SHM_ARGS, "--auth-token-file",
                         str(tmp_path / "tokens")) as server:  # fmt: skip
        assert register(server, "mine", key, 2 * query.nbytes, headers=alice)[0] == 200
        listed_to_bob = http(server, "GET", "/v2/systemsharedmemory/status", headers=bob)
        named_to_bob = http(server, "GET", "/v2/systemsharedmemory/region/mine/status", headers=bob)
        used_by_bob = infer(server, inputs, outputs, headers=bob)
        output_after_bob = np.frombuffer(shm.buf[query.nbytes :], np.float32).copy()
        unregistered_by_bob = http(server, "POST", "/v2/systemsharedmemory/unregister", headers=bob)  # "all" his
        with grpc.insecure_channel(server.url) as channel:  # gRPC alike: bob's own view has no region
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            over_grpc = stub.SystemSharedMemoryStatus(pb.SystemSharedMemoryStatusRequest(), timeout=10,
                                                      metadata=[("authorization", "Bearer bob-token")])  # fmt: skip
        # bob may name a region of his own as alice named hers
        assert register(server, "mine", key, query.nbytes, headers=bob)[0] == 200
        listed_to_alice = http(server, "GET", "/v2/systemsharedmemory/status", headers=alice)
        used_by_alice = infer(server, inputs, outputs, headers=alice)
        output_after_alice = np.frombuffer(shm.buf[query.nbytes :], np.float32).copy()
    assert listed_to_bob == (200, []) and named_to_bob[0] == 404 and not over_grpc.regions
    assert used_by_bob[0] == 400 and "unknown shared memory region 'mine'" in used_by_bob[1]["error"]
    assert unregistered_by_bob[0] == 200
    assert listed_to_alice[0] == 200 and [r["byte_size"] for r in listed_to_alice[1]] == [2 * query.nbytes]
    assert used_by_alice[0] == 200, used_by_alice
    assert not output_after_bob.any() and output_after_alice.any()  # written for alice only
