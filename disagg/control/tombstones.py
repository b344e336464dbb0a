"""Rooms that ended on this side, remembered for a while so a late message about one is
answered at once instead of waiting out a deadline (a decode whose prefill aborted would
otherwise hold its pages until its own timeout: the upstream 300 s stranding)."""

import threading
import time
from collections import OrderedDict


class Tombstones:
    """room -> reason, each kept for `ttl_s`, at most `capacity` (oldest dropped first)."""

    def __init__(self, ttl_s: float, capacity: int = 65536):
        self.ttl_s, self.capacity = ttl_s, capacity
        self._rooms: OrderedDict[int, tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    def bury(self, room: int, reason: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._rooms.pop(room, None)
            self._rooms[room] = (reason, now + self.ttl_s)
            while self._rooms and (len(self._rooms) > self.capacity or next(iter(self._rooms.values()))[1] <= now):
                self._rooms.popitem(last=False)

    def reason(self, room: int) -> str | None:
        with self._lock:
            entry = self._rooms.get(room)
            return entry[0] if entry is not None and entry[1] > time.monotonic() else None
