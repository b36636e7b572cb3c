"""HAProxy in front of several real servers, with the project's own configuration (deploy/haproxy/haproxy.cfg): the
clients send each step's sequence id in a header, HAProxy hashes it onto a ring of the servers, and every step of
every sequence reaches the server that holds it, over gRPC (HTTP/2) and HTTP/REST; stateless calls spread over the
servers. A step at the wrong server would be refused ("never started"), so every step answered, equal to the causal
answer, is every step at the right server.

Needs HAProxy (tests/tools/install_haproxy.sh installs Debian's); skipped without it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import numpy as np
import pytest

from mhaserve.client import Client, HttpClient
from mhaserve.server.process import free_port
from tests.support import ROOT, SMALL_D_MODEL, eager, rand

pytestmark = pytest.mark.skipif(
    shutil.which("haproxy") is None, reason="no haproxy (tests/tools/install_haproxy.sh installs Debian's)"
)


def causal(module, rows: np.ndarray) -> np.ndarray:
    length = rows.shape[1]
    return eager(module, rows, mask=np.tril(np.ones((length, length), dtype=bool))[None])[0]


def configured(servers, grpc_port: int, http_port: int) -> str:
    """The shipped configuration, its ports and server addresses this test's."""
    text = (ROOT / "deploy" / "haproxy" / "haproxy.cfg").read_text()
    text = text.replace("bind :8001", f"bind 127.0.0.1:{grpc_port}")
    text = text.replace("bind :8000", f"bind 127.0.0.1:{http_port}")
    for number, server in enumerate(servers, 1):
        http = server.http_url.removeprefix("http://")
        text = text.replace(f"server{number}:8001", server.url).replace(f"server{number}:8000", http)
    return text


def listening(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert time.monotonic() < deadline, f"nothing listens on {port}"
            time.sleep(0.1)


@pytest.fixture
def balanced(start_server_process, small_model_dir, tmp_path):
    servers = [start_server_process(small_model_dir, "--warmup-runs", "0") for _ in range(3)]
    grpc_port, http_port = free_port(), free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(configured(servers, grpc_port, http_port))
    proxy = subprocess.Popen(["haproxy", "-f", str(config), "-db"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        listening(grpc_port)
        listening(http_port)
        yield servers, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}"
    finally:
        proxy.terminate()
        proxy.wait(10)


def test_every_step_of_every_sequence_reaches_its_server_through_haproxy_over_grpc_and_http(balanced, small_module):
    servers, grpc_url, http_url = balanced
    rows = {number: rand(1, 4, SMALL_D_MODEL, seed=300 + number) for number in range(64)}
    answers: dict[int, list] = {number: [] for number in rows}
    with Client(grpc_url) as grpc_client:  # one connection to HAProxy: it picks the server per call
        http_client = HttpClient(http_url)
        sequences = {
            number: (grpc_client if number % 3 else http_client).sequence(f"balanced-{number}") for number in rows
        }
        for position in range(4):  # the sequences' steps interleaved
            for number, sequence in sequences.items():
                step = rows[number][:, position : position + 1]
                answers[number].append(sequence.step(step, attn_weights=False, end=position == 3))
        for seed in range(9):  # stateless calls, no header: round robin
            query = rand(1, 2, SMALL_D_MODEL, seed=seed)
            np.testing.assert_allclose(grpc_client.infer(query).output, eager(small_module, query)[0], atol=1e-5)
    for number in rows:
        got = np.concatenate([answer.output for answer in answers[number]], axis=1)
        np.testing.assert_allclose(got, causal(small_module, rows[number]), atol=1e-5, err_msg=f"{number}")
    counts = []
    for server in servers:
        with Client(server.url) as direct:
            counts.append(direct.statistics().inference_count)
    assert sum(counts) == 64 * 4 + 9 and all(count > 0 for count in counts), counts  # spread over all three
