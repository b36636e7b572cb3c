"""Requests of every kind the batcher meets, and ways to send them: built once for unit and server tests."""

from __future__ import annotations

import asyncio

import numpy as np

from mhaserve.client.grpc import AsyncClient, build_infer_request
from mhaserve.contract.signature import ModelSignature
from mhaserve.server.grpc.protobuf import decode_infer_request
from mhaserve.server.tensors import Limits, RunInputs

from . import SMALL_D_MODEL, SMALL_HEADS, rand

D = SMALL_D_MODEL


def mixed_requests(count: int, seed: int = 0):
    """(query, key, value, mask, attn_weights): lengths 1..48, self- and cross-attention, with and without masks."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(count):
        batch, q_len = int(rng.integers(1, 4)), int(rng.integers(1, 49))
        query = rand(batch, q_len, D, seed=1000 * seed + i)
        key = value = None
        kv_len = q_len
        if i % 3 == 1:  # cross-attention
            kv_len = int(rng.integers(1, 49))
            key, value = rand(batch, kv_len, D, seed=7 + i), rand(batch, kv_len, D, seed=11 + i)
        mask = None
        if i % 4 == 2:  # key padding
            mask = rng.random((batch, kv_len)) < 0.7
            mask[:, 0] = True
        elif i % 4 == 3:  # full mask with a fully masked row
            mask = (rng.random((batch, q_len, kv_len)) < 0.6).astype(np.int32)
            mask[:, :, 0] = 1
            mask[0, q_len // 2, :] = 0
        requests.append((query, key, value, mask, i % 5 != 4))
    return requests


def merged_when_all_queued(requests) -> tuple[str, ...]:
    """Server flags under which a take fires once every one of ``requests`` is queued (their rows fill the batch),
    however slowly a loaded machine sends them: the merge a test then sees does not depend on the machine."""
    rows = sum(query.shape[0] for query, *_ in requests)
    return ("--max-batch-size", str(rows), "--max-queue-delay-us", str(60_000_000))


def as_attention_request(query, key, value, mask, attn_weights) -> RunInputs:
    """Decoded as the server decodes it: the client's request through the codec."""
    request = build_infer_request("mha", query, key, value, mask, attn_weights)
    return decode_infer_request(request, ModelSignature("mha", "1", D, SMALL_HEADS), Limits(64, 64, 64))


def infer_concurrently(url: str, requests) -> list:
    """Every one of ``mixed_requests``'s requests sent at once from one asyncio client; the results in order."""

    async def call_all():
        async with AsyncClient(url) as client:
            return await asyncio.gather(
                *(client.infer(q, k, v, m, attn_weights=w, timeout=60) for q, k, v, m, w in requests)
            )

    return asyncio.run(call_all())
