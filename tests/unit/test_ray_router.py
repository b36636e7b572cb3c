"""Ray Serve's request router for sequences (server/ray/router.py), given the replicas Serve hands it: a step goes to
the replica that reports holding its sequence, whatever replicas were added since; a sequence no replica reports
goes to its place on the ring; a call without an id to any replica."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray")  # the ray extra (the test extra has it)

from mhaserve.contract.ring import Ring  # noqa: E402
from mhaserve.server.ray.router import HELD_SEQUENCES, SequenceRouter  # noqa: E402


def replica(name: str, *held: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats={HELD_SEQUENCES: list(held)})


def chosen(replicas, sequence_id: str) -> list[str]:
    router = object.__new__(SequenceRouter)  # Serve builds it with its own arguments; choosing needs none of them
    pending = SimpleNamespace(metadata=SimpleNamespace(multiplexed_model_id=sequence_id))
    ranks = asyncio.run(router.choose_replicas(replicas, pending))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks][0]


def test_a_replica_added_moves_no_sequence_a_replica_reports():
    ids = [f"seq-{n}" for n in range(24)]
    grown = Ring(["a", "b", "c"])
    moved = [i for i in ids if ["a", "b", "c"][grown.home_of(i)] == "c"]  # the ring alone would move these
    assert moved
    before = [replica("a"), replica("b")]
    homes = {i: chosen(before, i)[0] for i in ids}  # where their first steps went: the ring of two
    reported = [replica(name, *(i for i in ids if homes[i] == name)) for name in ("a", "b")]
    after = [*reported, replica("c")]
    assert all(chosen(after, i) == [homes[i]] for i in ids)
    assert chosen(after, "new-one") == [["a", "b", "c"][grown.home_of("new-one")]]  # not reported: the ring


def test_a_call_without_a_sequence_may_go_to_any_replica():
    replicas = [replica("a", "x"), replica("b")]
    assert chosen(replicas, "") == ["a", "b"]
