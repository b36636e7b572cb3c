"""Ray Serve's routing of a sequence's steps: every step through Ray's proxy reaches the replica that holds its
sequence. Clients send the sequence's id as ``multiplexed_model_id`` (gRPC metadata; the project's clients do so
on every step), which Ray's proxy hands to the deployment's request router; this router hashes it onto a ring of
the replicas (the consistent hashing the clients use over several servers, contract/ring.py), so that a replica
added or removed moves only its own sequences. Requests without it go to whichever replica reports the shortest
queue (Ray probes them all).

Imported by Serve's controller and proxies by its path (deployment.py names it); needs the ``[ray]`` extra.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from mhaserve.contract.ring import Ring

ROUTER_PATH = "mhaserve.server.ray.router:SequenceRouter"


class SequenceRouter(RequestRouter):
    """A request router that keeps each sequence on one replica (see the module doc)."""

    _rings: dict[tuple[str, ...], Ring] = {}

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        sequence_id = pending_request.metadata.multiplexed_model_id if pending_request is not None else ""
        if not sequence_id or not candidate_replicas:
            return [candidate_replicas]
        replicas = sorted(candidate_replicas, key=lambda replica: replica.replica_id.unique_id)
        ids = tuple(replica.replica_id.unique_id for replica in replicas)
        ring = self._rings.get(ids)
        if ring is None:  # the set of replicas changed: a ring for the new one
            ring = self._rings[ids] = Ring(list(ids))
            if len(self._rings) > 64:
                self._rings.pop(next(iter(self._rings)))
        return [[replicas[ring.home_of(sequence_id)]]]
