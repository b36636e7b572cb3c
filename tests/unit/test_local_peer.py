"""Shared memory is for callers on the server's host: the peer addresses both transports report, read."""

import pytest

from mhaserve.server.shared_memory import is_local_peer


@pytest.mark.parametrize(
    "peer", ["ipv4:127.0.0.1:50512", "ipv4:127.8.9.10:1", "ipv6:%5B::1%5D:50512", "ipv6:[::1]:7", "unix:/tmp/s",
             "unix-abstract:mhaserve", "127.0.0.1", "::1", "::ffff:127.0.0.1", "ipv6:%5B::ffff:127.0.0.1%5D:9"],
)  # fmt: skip
def test_loopback_and_unix_sockets_are_this_host(peer):
    assert is_local_peer(peer)


@pytest.mark.parametrize(
    "peer", ["ipv4:10.231.4.2:50512", "ipv6:%5Bfd00::2%5D:5", "192.0.2.2", "fe80::1%eth0", "", "localhost",
             "ipv4:127.0.0.1.evil.example:1", "::ffff:10.0.0.1"],
)  # fmt: skip
def test_every_other_address_is_not(peer):
    assert not is_local_peer(peer)
