"""Several servers of the same model behind one client: stateless calls spread over them, each sequence kept on
one by consistent hashing of its id (a ring of points per server), so that a server joining or leaving the set
moves only the sequences that were, or will be, its own. A server that cannot be reached is passed over for a
while; a sequence that lived there is lost with it (``client.sequence(resume=True)`` starts it again on the
server its id falls to next)."""

from __future__ import annotations

import bisect
import hashlib
import time

POINTS_PER_SERVER = 128  # points on the ring per server: the sequences' shares come out within a few percent
DOWN_FOR_S = 5.0  # a server that could not be reached is tried last for this long


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class ServerSet:
    """The addresses of servers of one model, and which to call for a request."""

    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("give at least one server address")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a server address is given twice: {urls}")
        self.urls = urls
        ring = sorted((_point(f"{url}#{n}"), index) for index, url in enumerate(urls) for n in range(POINTS_PER_SERVER))
        self._points = [point for point, _ in ring]
        self._owners = [index for _, index in ring]
        self._down_until = [0.0] * len(urls)
        self._turn = 0

    def home_of(self, sequence_id: int | str) -> int:
        """The server a sequence lives on while every server can be reached."""
        return self._ring_order(sequence_id)[0]

    def for_sequence(self, sequence_id: int | str) -> list[int]:
        """The servers to call for a step of ``sequence_id``, in order: its place on the ring, the servers that
        could not be reached lately passed over (tried last)."""
        return self._reachable_first(self._ring_order(sequence_id))

    def for_stateless(self) -> list[int]:
        """The servers to call for a stateless request, in order: each in turn, those that could not be reached
        lately tried last."""
        self._turn = (self._turn + 1) % len(self.urls)
        return self._reachable_first([(self._turn + n) % len(self.urls) for n in range(len(self.urls))])

    def unreachable(self, index: int) -> None:
        self._down_until[index] = time.monotonic() + DOWN_FOR_S

    def _ring_order(self, sequence_id: int | str) -> list[int]:
        start = bisect.bisect(self._points, _point(f"{type(sequence_id).__name__}:{sequence_id}"))
        order: list[int] = []
        for n in range(len(self._owners)):
            owner = self._owners[(start + n) % len(self._owners)]
            if owner not in order:
                order.append(owner)
                if len(order) == len(self.urls):
                    break
        return order

    def _reachable_first(self, order: list[int]) -> list[int]:
        now = time.monotonic()
        return sorted(order, key=lambda index: self._down_until[index] > now)  # stable: the order kept within each
