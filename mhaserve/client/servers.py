"""Several servers of the same model behind one client: stateless calls spread over them, each sequence kept on
one by consistent hashing of its id (a ring of points per server), so that a server joining or leaving the set
moves only the sequences that were, or will be, its own. A server that cannot be reached is passed over for a
while; a sequence that lived there is lost with it (``client.sequence(resume=True)`` starts it again on the
server its id falls to next)."""

from __future__ import annotations

import time

from mhaserve.contract.ring import Ring

DOWN_FOR_S = 5.0  # a server that could not be reached is tried last for this long


def address_of(url: str) -> str:
    """A server's address as the clients take it, host:port: one written as a URL (http://, https://) is refused,
    naming the address to give (gRPC would look the whole of it up as a host name)."""
    scheme, has_scheme, rest = url.partition("://")
    if has_scheme and scheme.lower() in ("http", "https"):
        tls = " with TLS" if scheme.lower() == "https" else ""
        raise ValueError(f"a server's address is host:port, got {url!r}: give {rest.rstrip('/')}{tls}")
    return url


class ServerSet:
    """The addresses of servers of one model, and which to call for a request."""

    def __init__(self, urls: list[str]):
        if not urls:
            raise ValueError("give at least one server address")
        if len(set(urls)) != len(urls):
            raise ValueError(f"a server address is given twice: {urls}")
        self.urls = [address_of(url) for url in urls]
        self._ring = Ring(urls)
        self._down_until = [0.0] * len(urls)
        self._turn = 0

    def home_of(self, sequence_id: int | str) -> int:
        """The server a sequence lives on while every server can be reached."""
        return self._ring.home_of(sequence_id)

    def for_sequence(self, sequence_id: int | str) -> list[int]:
        """The servers to call for a step of ``sequence_id``, in order: its place on the ring, the servers that
        could not be reached lately passed over (tried last)."""
        return self._reachable_first(self._ring.order_for(sequence_id))

    def for_stateless(self) -> list[int]:
        """The servers to call for a stateless request, in order: each in turn, those that could not be reached
        lately tried last."""
        self._turn = (self._turn + 1) % len(self.urls)
        return self._reachable_first([(self._turn + n) % len(self.urls) for n in range(len(self.urls))])

    def unreachable(self, index: int) -> None:
        self._down_until[index] = time.monotonic() + DOWN_FOR_S

    def _reachable_first(self, order: list[int]) -> list[int]:
        now = time.monotonic()
        return sorted(order, key=lambda index: self._down_until[index] > now)  # stable: the order kept within each
