"""The model on a real Ray cluster started with Serve's direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1 in every
node's environment): `mhaserve ray-deploy` says where the replica answers gRPC itself, and a client there gets the
eager answer with no proxy between them, while the proxy's port still answers."""

from __future__ import annotations

import importlib.util
import re

import numpy as np
import pytest

from mhaserve.client.grpc import Client
from tests.support import SMALL_D_MODEL, eager, rand
from tests.support.ray_deploy import ray_deployed

if importlib.util.find_spec("ray") is None:
    pytest.skip("Ray Serve is not installed (the ray extra; the test extra has it)", allow_module_level=True)

APP = "mha"


@pytest.fixture(scope="module")
def direct_cluster(small_model_dir):
    from ray.cluster_utils import Cluster

    # Read by Serve's controller and replicas as they start.
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("RAY_SERVE_ENABLE_DIRECT_INGRESS", "1")
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        grpc_port, said = ray_deployed(
            small_model_dir, cluster.address, APP, "--min-replicas", "1", "--max-replicas", "1"
        )
        yield grpc_port, said
    finally:
        cluster.shutdown()


def test_a_replica_answers_at_its_own_port_the_eager_answer_and_the_proxy_still_answers(direct_cluster, small_module):
    proxy_port, said = direct_cluster
    found = re.search(r"answer directly, without the proxy hop, at ([\d.]+:\d+)", said)
    assert found, said
    query = rand(1, 9, SMALL_D_MODEL, seed=31)
    want_output, want_weights = eager(small_module, query)
    for url in (found.group(1), f"127.0.0.1:{proxy_port}"):
        with Client(url, application=APP) as client:
            answer = client.infer(query, timeout=30)
        np.testing.assert_allclose(answer.output, want_output, atol=1e-4 * np.abs(want_output).max())
        np.testing.assert_allclose(answer.attn_weights, want_weights, atol=1e-5)
