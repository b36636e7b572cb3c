"""Several servers behind one client (mhaserve/client/servers.py): each sequence keeps to one server by consistent
hashing, so that a server leaving or joining moves only its own sequences; stateless calls take the servers in turn;
one that could not be reached is tried last."""

from __future__ import annotations

import asyncio
from collections import Counter

import numpy as np
import pytest

from mhaserve.client import AsyncClient, Client, HttpClient
from mhaserve.client.servers import ServerSet

URLS = ["10.0.0.1:8001", "10.0.0.2:8001", "10.0.0.3:8001"]
IDS = [f"seq-{n}" for n in range(3000)] + list(range(1, 1001))


def homes(servers: ServerSet) -> dict:
    return {sequence_id: servers.urls[servers.home_of(sequence_id)] for sequence_id in IDS}


def test_each_server_holds_a_share_of_the_sequences():
    shares = Counter(homes(ServerSet(URLS)).values())
    assert set(shares) == set(URLS)
    assert all(0.25 < count / len(IDS) < 0.42 for count in shares.values()), shares


@pytest.mark.parametrize("changed", URLS)
def test_a_server_leaving_the_set_moves_only_its_own_sequences_and_joining_moves_only_those_it_takes(changed):
    everyone = homes(ServerSet(URLS))
    without = homes(ServerSet([url for url in URLS if url != changed]))
    moved = {sequence_id for sequence_id in IDS if everyone[sequence_id] != without[sequence_id]}
    assert moved == {sequence_id for sequence_id in IDS if everyone[sequence_id] == changed}
    # read the other way: the server joining takes sequences from the others and moves no other
    assert all(everyone[sequence_id] == changed for sequence_id in moved)


def test_the_same_addresses_in_any_order_give_every_sequence_the_same_server():
    assert homes(ServerSet(URLS)) == homes(ServerSet(list(reversed(URLS))))


def test_stateless_calls_take_the_servers_in_turn_and_one_that_could_not_be_reached_last():
    servers = ServerSet(URLS)
    firsts = [servers.for_stateless()[0] for _ in range(6)]
    assert sorted(Counter(firsts).values()) == [2, 2, 2]
    servers.unreachable(1)
    assert all(servers.for_stateless()[-1] == 1 for _ in range(6))
    sequence_id = next(sequence_id for sequence_id in IDS if servers.home_of(sequence_id) == 1)
    order = servers.for_sequence(sequence_id)
    assert order[-1] == 1 and len(set(order)) == 3  # its next server on the ring, while its own is away


def test_an_address_given_twice_is_refused():
    with pytest.raises(ValueError, match="given twice"):
        ServerSet([URLS[0], URLS[0]])


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (lambda: Client("http://127.0.0.1:8001/"), "got 'http://127.0.0.1:8001/': give 127.0.0.1:8001"),
        (lambda: AsyncClient(["127.0.0.1:8001", "HTTP://10.0.0.2:8001"]), "give 10.0.0.2:8001"),
        (lambda: HttpClient("https://models.example:8000"), "give models.example:8000 with TLS"),
    ],
)
def test_an_address_written_as_a_url_is_refused_naming_the_address_to_give(make, said):
    with pytest.raises(ValueError, match="a server's address is host:port") as refused:  # gRPC looked it all up
        make()
    assert said in str(refused.value)


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf")])
def test_a_timeout_that_is_no_deadline_is_refused_before_the_call(timeout):
    query = np.zeros((1, 1, 8), np.float32)
    with Client("127.0.0.1:9") as client, pytest.raises(ValueError, match="timeout must be a number of seconds"):
        client.infer(query, timeout=timeout)  # -1 was taken as no deadline at all
    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        HttpClient("127.0.0.1:9").infer(query, timeout=timeout)

    async def asynchronously():
        async with AsyncClient("127.0.0.1:9") as client:
            await client.infer(query, timeout=timeout)

    with pytest.raises(ValueError, match="timeout must be a number of seconds"):
        asyncio.run(asynchronously())
