"""The model on a real Ray cluster deployed with `mhaserve ray-deploy --replica-port`: each replica also runs the
native server itself (no Ray in a request's path), and `ray-deploy` says where; a client there, without Ray's
'application' metadata, gets the eager answer, the proxy's port still answers, and both are the replica's one
server (the proxied call forwarded to it)."""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import time

import numpy as np
import pytest

from mhaserve.client.grpc import Client
from tests.support import SMALL_D_MODEL, eager, rand
from tests.support.ray_deploy import ray_deployed

if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray Serve is not installed (the ray extra; the test extra has it)", allow_module_level=True)

APP = "mha"


@pytest.fixture(scope="module")
def native_replica(small_model_dir):
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        grpc_port, said = ray_deployed(
            small_model_dir, cluster.address, APP, "--min-replicas", "1", "--max-replicas", "1", "--replica-port", "0"
        )
        yield grpc_port, said, cluster.address
    finally:
        cluster.shutdown()


def test_a_replica_serves_natively_where_ray_deploy_says_and_the_proxy_still_answers(native_replica, small_module):
    proxy_port, said, _ = native_replica
    found = re.search(r"serve natively, .* at ([\d.]+:\d+);", said)
    assert found, said
    query = rand(1, 9, SMALL_D_MODEL, seed=32)
    want_output, want_weights = eager(small_module, query)
    with Client(found.group(1)) as native:
        answer = native.infer(query, timeout=30)
        np.testing.assert_allclose(answer.output, want_output, atol=1e-4 * np.abs(want_output).max())
        np.testing.assert_allclose(answer.attn_weights, want_weights, atol=1e-5)
        with Client(f"127.0.0.1:{proxy_port}", application=APP) as proxied:
            answer = proxied.infer(query, timeout=30)
            np.testing.assert_allclose(answer.output, want_output, atol=1e-4 * np.abs(want_output).max())
            # One server behind both: its statistics count the proxied call too, once its answer is written (the
            # server's done callback), which may come a moment after the answer reached this client.
            assert successes_within(native, 2, seconds=10) == 2


def successes_within(client: Client, expected: int, seconds: float) -> int:
    """The server's count of successful inferences once it reaches ``expected``, or as it stands ``seconds`` on."""
    deadline = time.monotonic() + seconds
    while True:
        count = client.statistics(timeout=seconds).inference_stats.success.count
        if count >= expected or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


def native_servers(model_dir) -> list[tuple[int, int]]:
    """(pid, parent pid) of every `mhaserve serve` of ``model_dir`` listening on all interfaces (the replicas')."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if b"serve" in command and str(model_dir).encode() in command and b"0.0.0.0" in command:
            found.append((int(entry), parent))
    return found


def test_a_replica_killed_outright_takes_its_server_with_it_and_ray_starts_another(
    native_replica, small_model_dir, small_module
):
    import ray

    from mhaserve.server.ray.deployment import native_addresses

    (server, replica), *others = native_servers(small_model_dir)
    assert not others
    os.kill(replica, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while any(pid == server for pid, _ in native_servers(small_model_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(pid != server for pid, _ in native_servers(small_model_dir)), "the killed replica's server lives on"
    ray.init(address=native_replica[2], logging_level="WARNING", log_to_driver=False)
    try:
        # Until Serve sees the replica gone, its record stands (Serve reports it running): wait for a new one.
        killed = re.search(r"serve natively, .* at ([\d.]+:\d+);", native_replica[1]).group(1)
        deadline, addresses = time.monotonic() + 120, []
        while (not addresses or killed in addresses) and time.monotonic() < deadline:
            time.sleep(1)
            addresses = native_addresses(APP)
    finally:
        ray.shutdown()
    assert len(addresses) == 1 and killed not in addresses, f"no other replica serving natively: {addresses}"
    query = rand(1, 5, SMALL_D_MODEL, seed=33)
    with Client(addresses[0]) as client:
        answer = client.infer(query, timeout=30)
    np.testing.assert_allclose(answer.output, eager(small_module, query)[0], atol=1e-4)
