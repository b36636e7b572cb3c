"""Several native servers of one model behind the project's client, as compose replicas, Ray's native replicas
or Kubernetes pods run them: stateless calls spread over them, each sequence kept on one, and one server killed
outright: the sequences on the others never notice, those it held start again elsewhere from what the client kept.
Real processes."""

from __future__ import annotations

import asyncio
import signal

import grpc
import numpy as np
import pytest

from mhaserve.client import AsyncClient, Client
from mhaserve.client.grpc import GrpcRequestFailed
from tests.support import SMALL_D_MODEL, eager, rand


def causal(module, rows: np.ndarray) -> np.ndarray:
    length = rows.shape[1]
    return eager(module, rows, mask=np.tril(np.ones((length, length), dtype=bool))[None])[0]


@pytest.fixture
def three_servers(start_server_process, small_model_dir):
    return [start_server_process(small_model_dir, "--warmup-runs", "0") for _ in range(3)]


def test_a_server_killed_loses_only_its_own_sequences_and_resume_starts_them_again_elsewhere(
    three_servers, small_module
):
    urls = [server.url for server in three_servers]
    rows = {number: rand(1, 4, SMALL_D_MODEL, seed=200 + number) for number in range(12)}
    with Client(urls) as client:
        # four sequences on each server (the ports, so the ring, differ from run to run)
        names = [f"seq-{n}" for n in range(400)]
        chosen = [name for home in range(3) for name in [n for n in names if client.servers.home_of(n) == home][:4]]
        sequences = {number: client.sequence(name, resume=True) for number, name in enumerate(chosen)}
        homes = {number: client.servers.home_of(sequence.id) for number, sequence in sequences.items()}
        answers = {number: [sequence.step(rows[number][:, :2])] for number, sequence in sequences.items()}
        killed = homes[0]
        three_servers[killed].signal(signal.SIGKILL)
        three_servers[killed].wait_exit(30)
        for _ in range(6):  # stateless calls go on, over the servers that answer
            query = rand(1, 3, SMALL_D_MODEL, seed=7)
            np.testing.assert_allclose(client.infer(query).output, eager(small_module, query)[0], atol=1e-5)
        for number, sequence in sequences.items():
            answers[number].append(sequence.step(rows[number][:, 2:3]))
            answers[number].append(sequence.step(rows[number][:, 3:4], end=True))
    for number, sequence in sequences.items():
        got = np.concatenate([answer.output for answer in answers[number]], axis=1)
        np.testing.assert_allclose(got, causal(small_module, rows[number]), atol=1e-5, err_msg=f"{number}")
        assert sequence.restarts == (1 if homes[number] == killed else 0), (number, homes[number], killed)


def test_a_step_of_a_sequence_lost_with_its_server_says_so_without_resume(three_servers):
    urls = [server.url for server in three_servers]
    row = rand(1, 1, SMALL_D_MODEL, seed=8)
    with Client(urls) as client:
        sequence = client.sequence("lost-one")
        sequence.step(row)
        home = client.servers.home_of("lost-one")
        three_servers[home].signal(signal.SIGKILL)
        three_servers[home].wait_exit(30)
        with pytest.raises(GrpcRequestFailed) as lost:
            sequence.step(row)
    assert lost.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"lived on {urls[home]}" in lost.value.details() and "were lost" in lost.value.details()


def test_the_asyncio_client_keeps_sequences_alike(three_servers, small_module):
    urls = [server.url for server in three_servers]
    rows = rand(1, 3, SMALL_D_MODEL, seed=9)
    sequence = asyncio.run(_stepped_across_a_kill(urls, three_servers, rows, [None, None]))
    got = np.concatenate([answer.output for answer in sequence.answers], axis=1)
    np.testing.assert_allclose(got, causal(small_module, rows), atol=1e-5)
    assert sequence.restarts == 1


async def _stepped_across_a_kill(urls, servers, rows, answers):
    async with AsyncClient(urls) as client:
        sequence = client.sequence("async-seq", resume=True)
        answers[0] = await sequence.step(rows[:, :2])
        home = client.servers.home_of("async-seq")
        servers[home].signal(signal.SIGKILL)
        servers[home].wait_exit(30)
        answers[1] = await sequence.step(rows[:, 2:3], end=True)
    sequence.answers = answers
    return sequence
