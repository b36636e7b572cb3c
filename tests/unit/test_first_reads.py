"""The first reads of gRPC requests: one connection's at a time, and a connection in bad standing (its last call
refused while its request arrived: a stalled sender) waits behind connections in good standing, however early it
asked."""

from __future__ import annotations

import asyncio

from mhaserve.server.grpc.receipt import FirstReads, RecentConnections


def test_a_stalled_connection_queues_behind_callers_in_good_standing():
    async def scenario() -> list[str]:
        bad_standing = RecentConnections()
        reads = FirstReads(1, bad_standing)
        order = []
        bad_standing.add("stalled")  # its last call was refused while its request arrived
        await reads.acquire("holder")

        async def read(connection: str) -> None:
            await reads.acquire(connection)
            order.append(connection)
            reads.release(connection)

        stalled = asyncio.create_task(read("stalled"))  # asks first
        await asyncio.sleep(0)
        fresh = asyncio.create_task(read("fresh"))
        await asyncio.sleep(0)
        reads.release("holder")
        await asyncio.gather(stalled, fresh)
        return order

    assert asyncio.run(scenario()) == ["fresh", "stalled"]


def test_one_first_read_per_connection_and_a_cancelled_waiter_passes_its_turn_on():
    async def scenario() -> list[str]:
        reads = FirstReads(2, RecentConnections())
        order = []
        await reads.acquire("a")

        async def read(connection: str) -> None:
            await reads.acquire(connection)
            order.append(connection)
            reads.release(connection)

        second_of_a = asyncio.create_task(read("a"))  # waits for a's first read, though a slot is free
        await asyncio.sleep(0)
        assert order == []
        gone = asyncio.create_task(read("c"))
        await asyncio.sleep(0)  # took the free slot at once
        b = asyncio.create_task(read("b"))
        reads.release("a")
        gone.cancel()
        await asyncio.gather(second_of_a, b, return_exceptions=True)
        return order

    order = asyncio.run(scenario())
    assert "a" in order and "b" in order


def test_a_1_128_512_query_arrives_whole_within_its_streams_window():
    """A request not yet read may fill its stream's window and no more; a [1,128,512] query (256 KiB of tensor and
    its message's envelope, weights asked for) fits, so it is sent whole before its read is asked for rather than
    waiting for a window update."""
    import numpy as np

    from mhaserve.client.grpc import build_infer_request
    from mhaserve.server.grpc.receipt import STREAM_WINDOW_BYTES

    query = np.zeros((1, 128, 512), np.float32)
    request = build_infer_request("mha", query, attn_weights=True, num_heads=8)
    grpc_prefix = 5  # compressed flag and length
    assert len(request.SerializeToString()) + grpc_prefix <= STREAM_WINDOW_BYTES
