"""The model on a real Ray cluster: a head and two worker nodes on this machine (ray.cluster_utils.Cluster, the
way Ray documents simulating nodes: each a raylet of its own with its own resources), deployed with
`mhaserve ray-deploy`, called through Ray's gRPC proxy by tritonclient and the project's client; then one
worker node is killed under load."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import grpc
import numpy as np
import pytest

from mhaserve.client.common import SequenceStep
from mhaserve.client.grpc import Client, GrpcRequestFailed, RetryPolicy
from mhaserve.loadtest.checked_load import rss_mib
from mhaserve.protos.generated import grpc_service_pb2 as pb
from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc
from tests.support import SMALL_D_MODEL, SMALL_HEADS, eager, rand
from tests.support.ray_deploy import ray_deployed

if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray Serve is not installed (the ray extra; the test extra has it)", allow_module_level=True)

APP = "mha"
REPLICA_CLASS = f"ServeReplica:{APP}:{APP}"
DEADLINE_S = 10.0
LOSS_DEADLINE_S = 30.0  # a call's deadline while a node is lost
D = SMALL_D_MODEL


@pytest.fixture(scope="module")
def cluster(small_model_dir):
    import ray
    from ray.cluster_utils import Cluster

    started = time.monotonic()
    # The head runs Serve's controller and the one proxy (no CPUs to give replicas); replicas land on workers.
    # Its nodes as on a busy machine, where a proxy starts slower than Serve's ready check allows (5 s by default,
    # 1 ms here): ray-deploy gives its controller longer, or the first proxy, killed, fails the deploy.
    with pytest.MonkeyPatch.context() as environment:  # the nodes inherit it; ray-deploy, started later, does not
        environment.setenv("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "0.001")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
        workers = [cluster.add_node(num_cpus=2) for _ in range(2)]
    cluster.wait_for_nodes()
    grpc_port, said = ray_deployed(small_model_dir, cluster.address, APP, "--proxy-location", "HeadOnly",
                                   "--min-replicas", "2", "--max-replicas", "2")  # fmt: skip
    assert "answer directly" not in said  # no direct ingress here: calls go through the proxy
    ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    print(
        f"cluster of 3 nodes up and the model deployed in {time.monotonic() - started:.1f} s; its processes hold "
        f"{sum(rss_mib(pid) for pid in descendants(os.getpid())):.0f} MiB",
        file=sys.stderr,
    )
    try:
        yield SimpleNamespace(url=f"127.0.0.1:{grpc_port}", cluster=cluster, workers=workers, ray=ray)
    finally:
        ray.shutdown()
        cluster.shutdown()


def descendants(pid: int) -> list[int]:
    """Every process started under ``pid`` (the cluster's daemons and workers are this test's)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def live_replicas() -> list[dict]:
    """The GCS's records of the application's live replica actors (node, pid)."""
    from ray._private.state import actors

    return [a for a in actors().values() if a["ActorClassName"] == REPLICA_CLASS and a["State"] == "ALIVE"]


def replica_nodes(ray) -> list[str]:
    """The nodes of the application's live replicas."""
    return sorted(a["Address"]["NodeID"] for a in live_replicas())


def test_replicas_are_spread_over_both_workers_and_answer_tritonclient(cluster, small_model_dir, tmp_path):
    import onnxruntime as ort

    from tests.support.triton import cases, run_triton_client

    assert replica_nodes(cluster.ray) == sorted(w.node_id for w in cluster.workers)
    results = run_triton_client(cluster, tmp_path, "sync", application=APP)
    session = ort.InferenceSession(str(small_model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    for case, arrays in cases().items():
        query = arrays["query"]
        key, value = arrays.get("key", query), arrays.get("value", query)
        mask = arrays.get("mask", np.ones((1, 1, 1, key.shape[1]), dtype=bool))
        mask = mask.reshape(mask.shape[0], 1, 1, -1) if mask.ndim == 2 else mask
        want = session.run(None, {"query": query, "key": key, "value": value, "mask": mask})
        np.testing.assert_array_equal(results[f"{case}_output"], want[0])
        np.testing.assert_array_equal(results[f"{case}_attn_weights"], want[1])


def test_a_proxy_slower_to_start_than_serves_ready_check_is_waited_for(cluster):
    from ray._private.state import actors

    # The fixture's nodes give a proxy 1 ms to start: the first proxy was given longer, and it is the one serving.
    proxies = [a["State"] for a in actors().values() if a["ActorClassName"] == "ProxyActor"]
    assert proxies == ["ALIVE"]
    with Client(cluster.url, application=APP) as client:
        assert client.ready(timeout=DEADLINE_S)


def test_the_project_client_names_the_application_and_gets_the_native_servers_statuses(cluster):
    with Client(cluster.url, application=APP) as client:
        assert client.ready(timeout=DEADLINE_S)
        # Statistics come from whichever replica Ray routes the call to: its own counts.
        assert client.statistics(timeout=DEADLINE_S).name == APP
        assert client.infer(rand(2, 5, D), timeout=DEADLINE_S).attn_weights.shape[:2] == (2, SMALL_HEADS)
        with pytest.raises(grpc.RpcError) as wrong:
            client.infer(rand(1, 4, D - 1), timeout=DEADLINE_S)
        assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert wrong.value.details() == f"input 'query': shape [1, 4, {D - 1}], last dim {D - 1}, expected d_model {D}"


def test_stream_infer_through_the_proxy_answers_in_order(cluster):
    from mhaserve.client.grpc import build_infer_request, call_metadata, open_channel

    requests = [build_infer_request(APP, rand(1, n, D, seed=n)) for n in (3, 9, 5)]
    requests.insert(1, build_infer_request(APP, rand(1, 4, D + 1)))  # refused; the stream goes on
    with open_channel(cluster.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        answers = list(stub.ModelStreamInfer(iter(requests), timeout=DEADLINE_S, metadata=call_metadata(None, APP)))
    assert [a.error_message.split(":")[0] for a in answers] == ["", "INVALID_ARGUMENT", "", ""]
    assert [a.infer_response.outputs[0].shape[1] for a in answers if not a.error_message] == [3, 9, 5]


def test_every_step_of_every_sequence_through_the_proxy_reaches_the_replica_that_holds_it(cluster, small_module):
    # Ray's proxy picks a replica per call; the deployment's router (server/ray/router.py) picks the sequence's by
    # the id the client sends: a step at another replica would be refused "never started".
    rows = {number: rand(1, 4, SMALL_D_MODEL, seed=400 + number) for number in range(64)}
    answers: dict[int, list] = {number: [] for number in rows}
    with Client(cluster.url, application=APP) as client:
        sequences = {number: client.sequence(f"ray-{number}") for number in rows}
        for position in range(4):  # the sequences' steps interleaved
            for number, sequence in sequences.items():
                step = rows[number][:, position : position + 1]
                answers[number].append(sequence.step(step, attn_weights=False, end=position == 3))
    for number, steps in answers.items():
        length = rows[number].shape[1]
        causal = np.tril(np.ones((length, length), dtype=bool))[None]
        want = eager(small_module, rows[number], mask=causal)[0]
        np.testing.assert_allclose(np.concatenate([s.output for s in steps], axis=1), want, atol=1e-5)
    with Client(cluster.url, application=APP) as client, pytest.raises(GrpcRequestFailed) as unknown:
        client.infer(rows[0][:, :1], sequence=SequenceStep("never-started"))  # a step of no sequence it holds
    assert "or lost when a replica of this deployment exited" in unknown.value.details()  # resume=True reads it


def test_each_replica_reports_the_sequences_it_holds_to_the_router(cluster):
    # What the router reads (server/ray/router.py): Serve's controller asks each replica for its routing stats and
    # hands them to the proxies' routers, which send a step to the replica that reports its sequence.
    from mhaserve.server.ray.router import HELD_SEQUENCES

    with Client(cluster.url, application=APP) as client:
        for number in range(6):
            client.sequence(f"held-{number}").step(rand(1, 2, SMALL_D_MODEL, seed=number), attn_weights=False)
    reported = [
        cluster.ray.get(cluster.ray.get_actor(replica["Name"], namespace="serve").record_routing_stats.remote())
        for replica in live_replicas()
    ]
    held = [{key for key in stats[HELD_SEQUENCES] if key.startswith("held-")} for stats in reported]
    assert sorted(key for keys in held for key in keys) == [f"held-{number}" for number in range(6)], reported


def test_a_replica_killed_loses_its_sequences_saying_so_and_resume_continues_them(cluster, small_module):
    rows = {number: rand(1, 6, SMALL_D_MODEL, seed=700 + number) for number in range(12)}
    with Client(cluster.url, application=APP) as client:
        sequences = {number: client.sequence(f"killed-{number}", resume=True) for number in rows}
        answers = {number: [s.step(rows[number][:, :3], attn_weights=False)] for number, s in sequences.items()}
        victim = live_replicas()[0]["Pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120  # Ray starts another in its place
        while (
            len(live_replicas()) < 2 or victim in {a["Pid"] for a in live_replicas()}
        ) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(live_replicas()) == 2, live_replicas()
        for number, sequence in sequences.items():
            answers[number].append(sequence.step(rows[number][:, 3:], attn_weights=False, end=True))
    # the killed replica's sequences (about half) were started again from what the client kept, the others went on
    assert 0 < sum(s.restarts for s in sequences.values()) < len(sequences)
    causal = np.tril(np.ones((6, 6), dtype=bool))[None]
    for number, steps in answers.items():
        want = eager(small_module, rows[number], mask=causal)[0]
        np.testing.assert_allclose(np.concatenate([s.output for s in steps], axis=1), want, atol=1e-5)


def test_a_worker_node_killed_under_load_costs_no_request(cluster):
    """SIGKILL of one worker node's raylet and workers while four callers send: the replica there is
    rescheduled on the survivor, no call outlives its deadline, and every refusal during the loss is retryable
    (or an attempt given up after its attempt timeout), so the client's retry policy turns each into a
    success. The calls' deadline is the cluster's, not a request's: on a host busy enough that a handful of calls
    make it through in the seconds around the loss, all four callers ran out a 10 s deadline at once."""
    ray = cluster.ray
    stop = threading.Event()
    outcomes: Counter[str] = Counter()
    retried, slowest = [0], [0.0]
    lock = threading.Lock()

    def caller(seed: int) -> None:
        query = rand(1, 8, D, seed=seed)
        # a call in flight on the node killed gets no answer until Ray notices the node gone: given up after 3 s
        retry = RetryPolicy(max_attempts=16, attempt_timeout_s=3)
        with Client(cluster.url, application=APP, retry=retry) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    client.infer(query, timeout=LOSS_DEADLINE_S)
                    status = "OK"
                except grpc.RpcError as error:
                    status = error.code().name
                with lock:
                    outcomes[status] += 1
                    slowest[0] = max(slowest[0], time.monotonic() - started)
            with lock:
                retried[0] += client.retries

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(3)
    killed = time.monotonic()
    cluster.cluster.remove_node(cluster.workers[1], allow_graceful=False)
    survivor = cluster.workers[0].node_id
    recovered = None
    while time.monotonic() - killed < 90:
        if replica_nodes(ray) == [survivor, survivor]:
            recovered = time.monotonic() - killed
            break
        time.sleep(0.25)
    time.sleep(3)  # load on the recovered application
    stop.set()
    for thread in threads:
        thread.join(timeout=LOSS_DEADLINE_S * 2)
    sent = sum(outcomes.values())
    said = (
        f"killed worker node: {sent} requests, {outcomes['OK']} succeeded, {retried[0]} retries, "
        f"{sent - outcomes['OK']} failed {dict(outcomes)}; replicas back on the survivor after {recovered} s; "
        f"slowest call {slowest[0]:.2f} s"
    )
    print(said, file=sys.stderr)
    assert recovered is not None, f"replicas did not come back: {replica_nodes(ray)}; {said}"
    assert outcomes["OK"] == sent > 0, said
    assert slowest[0] < LOSS_DEADLINE_S + 1, said
    with Client(cluster.url, application=APP, retry=RetryPolicy(max_attempts=1)) as client:
        assert client.infer(rand(1, 8, D), timeout=DEADLINE_S).output.shape == (1, 8, D)


def test_replicas_never_load_torch_and_the_cli_calls_them(cluster):
    for replica in live_replicas():
        maps = Path(f"/proc/{replica['Pid']}/maps").read_text()
        assert "onnxruntime" in maps and "libtorch" not in maps and "/torch/" not in maps
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "infer", "--url", cluster.url, "--application", APP,
         "--batch", "2", "--q-len", "5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"output: [2, 5, {D}]" in done.stdout


def test_server_metadata_and_health_rpcs_are_the_replicas(cluster):
    with grpc.insecure_channel(cluster.url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = (("application", APP),)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=DEADLINE_S, metadata=metadata).live
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=DEADLINE_S, metadata=metadata).ready
        server = stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=DEADLINE_S, metadata=metadata)
        assert server.name == "mhaserve"
        # the extensions whose calls Ray's proxy brings to a replica, and no other (no repository, trace or logging)
        assert sorted(server.extensions) == ["model_configuration", "statistics"]
        config = stub.ModelConfig(pb.ModelConfigRequest(name=APP), timeout=DEADLINE_S, metadata=metadata).config
        assert config.name == APP


@pytest.mark.parametrize(
    "args, says",
    [
        (["/nonexistent"], "/nonexistent: no such folder"),
        (["{model}", "--address", "127.0.0.1:1"], "no Ray cluster answers at --address 127.0.0.1:1"),
        (["{model}", "--min-replicas", "3", "--max-replicas", "2"], "--min-replicas 3 is more than --max-replicas 2"),
        (["{model}", "--replica-port", "70000"], "expected a whole number from 0 to 65535, got '70000'"),
    ],
)
def test_ray_deploy_refuses_bad_input_in_one_line(small_model_dir, args, says):
    args = [arg.format(model=small_model_dir) for arg in args]
    done = subprocess.run(
        [sys.executable, "-m", "mhaserve.cli", "ray-deploy", *args], capture_output=True, text=True, timeout=60
    )
    said, *rest = done.stderr.splitlines()
    assert done.returncode == 2 and says in said, done.stderr
    assert rest in ([], ["(the flags: mhaserve ray-deploy --help)"]), done.stderr  # argparse's: where to look
