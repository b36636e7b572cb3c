"""Callers told apart: each client's named token (or its client certificate under mutual TLS) is its identity, and
a sequence answers only the identity that started it: another client naming the same id meets no sequence, as if
it did not exist, and cannot read or change it. Each client holds at most its share of the sequences."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from mhaserve.client import TLS, Client
from mhaserve.client.common import SequenceStep
from tests.support import SMALL_D_MODEL, TEST_SERVER_ARGS, eager, rand, scrape
from tests.support.certs import CertificateAuthority
from tests.support.in_process import InProcessServer

D = SMALL_D_MODEL
TOKENS = {"alice": "token-of-alice", "bob": "token-of-bob"}


@pytest.fixture(scope="module")
def named_tokens_server(small_model_dir, tmp_path_factory):
    token_file = tmp_path_factory.mktemp("tokens") / "tokens"
    token_file.write_text("# one client a line\n" + "".join(f"{name} {token}\n" for name, token in TOKENS.items()))
    args = ("--auth-token-file", str(token_file), "--max-sequences-per-client", "2")
    with InProcessServer(small_model_dir, *TEST_SERVER_ARGS, *args) as server:
        yield server


def steps_of_two_clients(alice: Client, bob: Client, small_module):
    """Alice starts sequence 42; Bob names 42 too: first without a start, then starting his own."""
    x = rand(1, 4, D, seed=21)
    alice.infer(x[:, :3], sequence=SequenceStep(42, start=True))
    with pytest.raises(grpc.RpcError) as refused:  # Alice's keys and values are not Bob's to read
        bob.infer(x[:, 3:], sequence=SequenceStep(42))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sequence 42 is not live: never started" in refused.value.details()
    own = bob.infer(rand(1, 5, D, seed=22), sequence=SequenceStep(42, start=True))  # his own 42
    assert own.attn_weights.shape == (1, 4, 5, 5)
    last = alice.infer(x[:, 3:], sequence=SequenceStep(42, end=True))  # untouched: over her 4 keys
    want_output, want_weights = eager(small_module, x, mask=np.tril(np.ones((1, 4, 4), bool)))
    np.testing.assert_allclose(last.output, want_output[:, 3:], atol=1e-4 * np.abs(want_output).max())
    np.testing.assert_allclose(last.attn_weights, want_weights[:, :, 3:], atol=1e-5)
    bob.infer(rand(1, 1, D), sequence=SequenceStep(42, end=True))


def test_a_sequence_answers_only_the_token_that_started_it(named_tokens_server, small_module):
    url = named_tokens_server.url
    with Client(url, token=TOKENS["alice"]) as alice, Client(url, token=TOKENS["bob"]) as bob:
        steps_of_two_clients(alice, bob, small_module)


def test_over_http_too_a_sequence_answers_only_the_token_that_started_it(named_tokens_server):
    import json
    import urllib.error
    import urllib.request

    def http_step(token: str, start: bool, end: bool = False) -> tuple[int, dict]:
        body = {"inputs": [{"name": "query", "shape": [1, 1, D], "datatype": "FP32", "data": [0.5] * D}],
                "parameters": {"sequence_id": 77, "sequence_start": start, "sequence_end": end}}  # fmt: skip
        request = urllib.request.Request(
            named_tokens_server.http_url + "/v2/models/mha/infer", data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {token}"}, method="POST",
        )  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    assert http_step(TOKENS["alice"], start=True)[0] == 200
    status, answer = http_step(TOKENS["bob"], start=False)
    assert status == 400 and "sequence 77 is not live: never started" in answer["error"]
    assert http_step(TOKENS["alice"], start=False, end=True)[0] == 200


def test_each_named_client_holds_its_share_of_the_sequences(named_tokens_server):
    url = named_tokens_server.url
    rows = rand(1, 2, D)
    shed = ("mhaserve_inference_request_shed_total", (("model", "mha"), ("reason", "client_share"), ("version", "1")))
    shed_before = scrape(named_tokens_server.metrics_url)[shed]
    with Client(url, token=TOKENS["alice"]) as alice, Client(url, token=TOKENS["bob"]) as bob:
        for sequence_id in ("a1", "a2"):
            alice.infer(rows, sequence=SequenceStep(sequence_id, start=True))
        with pytest.raises(grpc.RpcError) as refused:
            alice.infer(rows, sequence=SequenceStep("a3", start=True))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-sequences-per-client=2" in refused.value.details()
        assert scrape(named_tokens_server.metrics_url)[shed] == shed_before + 1
        alice.infer(rows, sequence=SequenceStep("a1", start=True))  # restarting one of hers takes no more
        bob.infer(rows, sequence=SequenceStep("b1", start=True, end=True))  # the others are not held back
        for sequence_id in ("a1", "a2"):
            alice.infer(rows, sequence=SequenceStep(sequence_id, end=True))


# Pairs of client certificates that are two callers: the common name alone does not make one caller, nor does
# the absence of any subject (SPIFFE workloads name themselves by a URI SAN only).
CERTIFICATE_PAIRS = {
    "two common names": ({"common_name": "alice"}, {"common_name": "bob"}),
    "one common name, two organisations": (
        {"common_name": "alice", "organization": "Acme"},
        {"common_name": "alice", "organization": "Other"},
    ),
    "two SPIFFE IDs, no subject": (
        {"common_name": "", "uris": ("spiffe://example.org/ns/a/sa/alice",)},
        {"common_name": "", "uris": ("spiffe://example.org/ns/a/sa/bob",)},
    ),
    "two DNS names, one common name": (
        {"common_name": "svc", "dns_names": ("alice.example",)},
        {"common_name": "svc", "dns_names": ("bob.example",)},
    ),
}


@pytest.mark.parametrize("pair", CERTIFICATE_PAIRS)
def test_client_certificates_tell_callers_apart(small_model_dir, small_module, tmp_path, pair):
    server_ca, client_ca = CertificateAuthority(tmp_path, "server"), CertificateAuthority(tmp_path, "clients")
    server_cert = server_ca.issue("server", "localhost", server=True)
    alice_cert, bob_cert = (client_ca.issue(stem, server=False, **names)
                            for stem, names in zip(("alice", "bob"), CERTIFICATE_PAIRS[pair], strict=True))  # fmt: skip
    args = ("--tls-cert-file", str(server_cert.cert), "--tls-key-file", str(server_cert.key),
            "--tls-client-ca-file", str(client_ca.bundle))  # fmt: skip
    with InProcessServer(small_model_dir, *TEST_SERVER_ARGS, *args) as server:
        url = server.url.replace("127.0.0.1", "localhost")

        def tls(cert):
            return TLS(ca=server_ca.bundle, cert=cert.cert, key=cert.key)

        with Client(url, tls=tls(alice_cert)) as alice, Client(url, tls=tls(bob_cert)) as bob:
            steps_of_two_clients(alice, bob, small_module)


def test_without_identities_ids_are_global_as_in_triton(start_server, small_model_dir):
    server = start_server(small_model_dir, *TEST_SERVER_ARGS)
    x = rand(1, 3, D, seed=23)
    with Client(server.url) as one, Client(server.url) as other:
        one.infer(x[:, :2], sequence=SequenceStep("shared", start=True))
        answer = other.infer(x[:, 2:], sequence=SequenceStep("shared", end=True))
    assert answer.attn_weights.shape == (1, 4, 1, 3)


def test_a_certificate_is_the_same_caller_over_grpc_and_http(small_model_dir, tmp_path):
    import json
    import ssl
    import urllib.error
    import urllib.request

    server_ca, client_ca = CertificateAuthority(tmp_path, "server"), CertificateAuthority(tmp_path, "clients")
    server_cert = server_ca.issue("server", "localhost", server=True)
    alice, stranger = (client_ca.issue(stem, "", server=False, uris=(f"spiffe://example.org/{stem}",))
                       for stem in ("alice", "stranger"))  # fmt: skip
    args = ("--tls-cert-file", str(server_cert.cert), "--tls-key-file", str(server_cert.key),
            "--tls-client-ca-file", str(client_ca.bundle))  # fmt: skip

    def http_step(cert, end: bool) -> int:
        context = ssl.create_default_context(cafile=server_ca.bundle)
        context.load_cert_chain(cert.cert, cert.key)
        body = {"inputs": [{"name": "query", "shape": [1, 1, D], "datatype": "FP32", "data": [0.5] * D}],
                "parameters": {"sequence_id": 5, "sequence_end": end}}  # fmt: skip
        url = server.http_url.replace("http://127.0.0.1", "https://localhost") + "/v2/models/mha/infer"
        try:
            with urllib.request.urlopen(url, json.dumps(body).encode(), timeout=10, context=context) as answer:
                return answer.status
        except urllib.error.HTTPError as error:
            return error.code

    with InProcessServer(small_model_dir, *TEST_SERVER_ARGS, *args) as server:
        url = server.url.replace("127.0.0.1", "localhost")
        with Client(url, tls=TLS(ca=server_ca.bundle, cert=alice.cert, key=alice.key)) as client:
            client.infer(rand(1, 2, D), sequence=SequenceStep(5, start=True))
        assert http_step(stranger, end=False) == 400  # not his sequence
        assert http_step(alice, end=True) == 200  # hers, over the other transport


def test_one_clients_idle_streams_delay_anothers_stream_by_one_hold_at_most(small_model_dir, tmp_path):
    import queue
    import time

    from mhaserve.client.grpc import build_infer_request
    from mhaserve.protos.generated import grpc_service_pb2_grpc as pb_grpc

    request = build_infer_request("mha", rand(1, 4, D, seed=16))
    own_connection = [("grpc.use_local_subchannel_pool", 1)]

    def stub_of(channel):
        return pb_grpc.GRPCInferenceServiceStub(channel)

    (tmp_path / "tokens").write_text("".join(f"{name} {token}\n" for name, token in TOKENS.items()))
    args = ("--auth-token-file", str(tmp_path / "tokens"), "--max-receiving-bytes", "1")  # one receiving turn
    with (
        InProcessServer(small_model_dir, *TEST_SERVER_ARGS, *args) as server,
        grpc.insecure_channel(server.url, options=own_connection) as greedy,
        grpc.insecure_channel(server.url, options=own_connection) as other,
    ):
        alice = [("authorization", f"Bearer {TOKENS['alice']}")]
        idle = []
        for _ in range(16):  # opened, never sent on: each waits for a receiving turn, or holds one idle
            sending = queue.Queue()
            idle.append((sending, stub_of(greedy).ModelStreamInfer(iter(sending.get, None), metadata=alice)))
        time.sleep(0.5)
        started = time.monotonic()
        answers = list(stub_of(other).ModelStreamInfer(
            iter([request]), timeout=20, metadata=[("authorization", f"Bearer {TOKENS['bob']}")]
        ))  # fmt: skip
        took = time.monotonic() - started
        for sending, _ in idle:
            sending.put(None)
    assert len(answers) == 1 and not answers[0].error_message
    # the stream holding the turn idle gives way after --stream-read-hold-s (1 s); then bob's is next, not after
    # each of alice's 15 others (14 s)
    assert took < 2.5, took
