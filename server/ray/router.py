"""Ray Serve's routing of a sequence's steps: every step through Ray's proxy reaches the replica that holds its
sequence. Clients send the sequence's id as ``multiplexed_model_id`` (gRPC metadata; the project's clients do so
on every step), which Ray's proxy hands to the deployment's request router. Each replica reports the sequences it
holds in its routing stats (deployment.py, every ROUTING_STATS_PERIOD_S), and a step goes to the replica that
reports its sequence, so replicas added later move none; a sequence no replica reports yet (its first steps) goes
to its place on a ring of the replicas (the consistent hashing the clients use over several servers,
contract/ring.py), the same from every proxy. Requests without an id go to whichever replica reports the shortest
queue (Ray probes them all).

Imported by Serve's controller and proxies by its path (deployment.py names it); needs the ``[ray]`` extra.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from mhaserve.contract.ring import Ring

ROUTER_PATH = "mhaserve.server.ray.router:SequenceRouter"
HELD_SEQUENCES = "sequences"  # the routing stats' entry: the routing keys (contract/ring.py) of those a replica holds
# How often Ray Serve asks each replica for its routing stats: a sequence is found where it lives this soon after
# its first step, and until then it is where the ring puts it.
ROUTING_STATS_PERIOD_S = 1.0


class SequenceRouter(RequestRouter):
    """A request router that keeps each sequence on one replica (see the module doc)."""

    _rings: dict[tuple[str, ...], Ring] = {}
    # replica id -> (the list of sequences its last routing stats reported, the same as a set)
    _held: dict[str, tuple[list, frozenset]] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        sequence_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not sequence_id or not candidate_replicas:
            return [candidate_replicas]
        for replica in candidate_replicas:
            if sequence_id in self._held_by(replica):
                return [[replica]]
        replicas = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        ids = tuple(replica.replica_id.unique_id for replica in replicas)
        ring = self._rings.get(ids)
        if ring is None:  # the set of replicas changed: a ring for the new one
            ring = self._rings[ids] = Ring(list(ids))
            if len(self._rings) > 64:
                self._rings.pop(next(iter(self._rings)))
        return [[replicas[ring.home_of(sequence_id)]]]

    def _held_by(self, replica: RunningReplica) -> frozenset:
        """The routing keys of the sequences ``replica`` last reported holding (a set made once per report)."""
        reported = (replica.routing_stats or {}).get(HELD_SEQUENCES, [])
        unique_id = replica.replica_id.unique_id
        known = self._held.get(unique_id)
        if known is None or known[0] is not reported:
            known = self._held[unique_id] = (reported, frozenset(reported))
            if len(self._held) > 256:
                self._held.pop(next(iter(self._held)))
        return known[1]
