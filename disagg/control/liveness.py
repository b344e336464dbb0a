"""Liveness: when each peer was last heard from, and which have been silent too long. Both
roles use it from their loop thread (prefill for decode identities, decode for prefill
endpoints); a peer silent for `dead_after_s` fails exactly its own requests."""

import time
from collections.abc import Hashable


class Liveness:
    def __init__(self, dead_after_s: float):
        if dead_after_s <= 0:
            raise ValueError("dead_after_s must be > 0")
        self.dead_after_s = dead_after_s
        self._seen: dict[Hashable, float] = {}

    def heard(self, peer: Hashable) -> None:
        self._seen[peer] = time.monotonic()

    def forget(self, peer: Hashable) -> None:
        self._seen.pop(peer, None)

    def known(self, peer: Hashable) -> bool:
        return peer in self._seen

    def silent(self, now: float | None = None) -> list[Hashable]:
        """Peers not heard from for dead_after_s; they are forgotten here."""
        now = time.monotonic() if now is None else now
        gone = [p for p, t in self._seen.items() if now - t > self.dead_after_s]
        for p in gone:
            del self._seen[p]
        return gone
