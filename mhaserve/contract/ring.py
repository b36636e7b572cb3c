"""Consistent hashing, as the clients and the Ray router both place sequences: each member (a server's address, a
replica's id) holds many points on a ring, and a sequence belongs to the member of the first point after its id's,
so that a member joining or leaving moves only the sequences that were, or become, its own."""

from __future__ import annotations

import bisect
import hashlib

POINTS_PER_MEMBER = 128  # the members' shares of the sequences come out within a few percent


def point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Ring:
    """The members of a ring, by their names (any order gives the same placement)."""

    def __init__(self, members: list[str]):
        ring = sorted(
            (point(f"{member}#{n}"), index) for index, member in enumerate(members) for n in range(POINTS_PER_MEMBER)
        )
        self.size = len(members)
        self._points = [at for at, _ in ring]
        self._owners = [index for _, index in ring]

    def order_for(self, sequence_id: int | str) -> list[int]:
        """Every member's index, in the order the ring gives them for ``sequence_id``: its own first."""
        start = bisect.bisect(self._points, point(f"{type(sequence_id).__name__}:{sequence_id}"))
        order: list[int] = []
        for n in range(len(self._owners)):
            owner = self._owners[(start + n) % len(self._owners)]
            if owner not in order:
                order.append(owner)
                if len(order) == self.size:
                    break
        return order

    def home_of(self, sequence_id: int | str) -> int:
        return self.order_for(sequence_id)[0]


# The header (gRPC metadata) in which the clients send a step's sequence id, beside the protocol's parameter: a
# balancer in front of several servers hashes it to keep every step of a sequence on one (deploy/haproxy), and Ray
# Serve's router (server/ray/router.py) finds the replica holding it by it.
SEQUENCE_HEADER = "mhaserve-sequence-id"


def sequence_header(sequence_id: int | str) -> str:
    """The header's value for a sequence id: the id itself where it is printable ASCII (what headers may carry),
    else a digest of it, the same for every step."""
    text = str(sequence_id)
    if text.isascii() and text.isprintable():
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()
