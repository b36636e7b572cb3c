"""The token file: one shared token, or one named token per client; a call's caller is its token's name, else its
certificate's, else no one in particular."""

from __future__ import annotations

import pytest

from mhaserve.server.security import Callers, SecurityConfigError, Tokens, certificate_identity, load_token


def test_one_token_is_shared_and_names_no_one(tmp_path):
    (tmp_path / "token").write_text("  s3cret\n")
    tokens = load_token(tmp_path / "token")
    assert tokens == Tokens({"s3cret": ""}) and tokens.holder("Bearer s3cret") == ""
    assert not Callers(tokens).told_apart and Callers(tokens).identify(["Bearer s3cret"], "") == ""


def test_named_tokens_name_their_holders(tmp_path):
    (tmp_path / "tokens").write_text("# clients\nalice aaa\n\nbob bbb\n")
    tokens = load_token(tmp_path / "tokens")
    assert tokens.holder("bearer aaa") == "alice" and tokens.holder("Bearer bbb") == "bob"
    assert tokens.holder("Bearer ccc") is None and tokens.holder("Basic aaa") is None
    assert tokens.holder_of(["Bearer aaa", "Bearer bbb"]) is None  # two tokens: neither
    callers = Callers(tokens, certificates=True)
    assert callers.told_apart and callers.identify(["Bearer bbb"], "CN=alice") == "token bob"
    assert callers.identify([], "CN=alice") == "certificate CN=alice"


@pytest.mark.parametrize(
    "content,message",
    [
        ("alice aaa\nbob\n", "line 2 of the tokens: expected 'NAME TOKEN'"),
        ("alice aaa\nbob aaa\n", "clients 'alice' and 'bob' have the same token"),
        ("alice aaa\nalice bbb\n", "the client name 'alice' is given twice"),
        ("# nothing\n\n", "is empty"),
    ],
)
def test_a_token_file_that_is_not_clear_is_refused_saying_why(tmp_path, content, message):
    (tmp_path / "tokens").write_text(content)
    with pytest.raises(SecurityConfigError, match=message):
        load_token(tmp_path / "tokens")


def test_a_certificate_names_its_uri_san_else_its_dns_san_else_its_whole_subject_else_its_fingerprint(tmp_path):
    from tests.support.certs import CertificateAuthority

    ca = CertificateAuthority(tmp_path, "clients")

    def identity(stem: str, common_name: str, **names) -> str:
        return certificate_identity(ca.issue(stem, common_name, server=False, **names).cert.read_bytes())

    spiffe = identity("workload", "", uris=("spiffe://example.org/ns/a/sa/b",), dns_names=("a.example",))
    other_workload = identity("other", "", uris=("spiffe://example.org/ns/a/sa/c",))
    dns = identity("host", "alice", dns_names=("alice.example",))
    alice_acme = identity("alice-acme", "alice", organization="Acme")
    alice_other = identity("alice-other", "alice", organization="Other")
    nameless = identity("nameless", "")
    assert (spiffe, other_workload) == ("spiffe://example.org/ns/a/sa/b", "spiffe://example.org/ns/a/sa/c")
    assert dns == "DNS:alice.example"
    assert (alice_acme, alice_other) == ("O=Acme,CN=alice", "O=Other,CN=alice")  # never the common name alone
    assert nameless.startswith("sha256:") and nameless != identity("nameless-2", "")  # each one someone
    assert certificate_identity(b"") == ""


def test_a_token_file_saved_with_a_byte_order_mark_or_crlf_line_ends_reads_as_text(tmp_path):
    (tmp_path / "one").write_bytes("\ufeffs3cret\r\n".encode())
    (tmp_path / "named").write_bytes("\ufeff# clients\r\nalice aaa\r\nbob bbb\r\n".encode())
    assert load_token(tmp_path / "one").holder("Bearer s3cret") == ""
    named = load_token(tmp_path / "named")
    assert named.holder("Bearer aaa") == "alice" and named.holder("Bearer bbb") == "bob"


def test_a_token_file_that_is_not_utf8_is_refused_saying_so(tmp_path):
    (tmp_path / "tokens").write_bytes(b"alice \xff\xfe\n")
    with pytest.raises(SecurityConfigError, match="not UTF-8"):
        load_token(tmp_path / "tokens")


def test_a_large_token_file_reads_in_linear_time_and_a_lookup_does_not_grow_with_it(tmp_path):
    import time

    count = 200_000
    (tmp_path / "tokens").write_text("".join(f"client{n} token-{n:032x}\n" for n in range(count)))
    started = time.perf_counter()
    tokens = load_token(tmp_path / "tokens")
    read_s = time.perf_counter() - started
    started = time.perf_counter()
    for n in range(0, count, count // 1000):
        assert tokens.holder(f"Bearer token-{n:032x}") == f"client{n}"
    lookup_s = (time.perf_counter() - started) / 1000
    # Read quadratically (a scan of the names for each line), 40,000 lines took 10.7 s; a lookup that walked
    # the list took milliseconds at 20,000.
    assert read_s < 5 and lookup_s < 50e-6, (read_s, lookup_s)
