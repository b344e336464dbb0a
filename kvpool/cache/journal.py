"""Journal: what a prefix cache added and evicted, by chained page key, numbered, for readers
that keep a copy of the cache's contents (the router's index, disagg/router/cache_index.py).

    seq 0 ── +[a b c] ── 1 ── +[d] ── 2 ── -[d c] ── 3 ...     one entry per change, numbered

A reader that last saw `seq` asks for what followed it (`since(seq)`: added, evicted); when
that is no longer kept (the journal keeps at most `keep` keys, oldest dropped first), or the
reader has seen nothing yet, it is told to start again from the whole contents (None), which
the cache's owner answers with every key it holds. So a reader's cost follows the changes,
not the cache's size, and a slow reader costs the journal nothing beyond its bound.
"""

from collections import deque
from dataclasses import dataclass

import numpy as np

KEEP = 1 << 16  # keys kept for readers that are behind (about 1 MiB of int64)


@dataclass(frozen=True)
class Changes:
    """What happened after a reader's `since`, up to `seq`, net: each key in one of the two,
    by its last change in the span (so the order of applying them does not matter)."""

    seq: int
    added: np.ndarray  # uint64
    evicted: np.ndarray  # uint64


class Journal:
    def __init__(self, keep: int = KEEP):
        self.keep = keep
        self.seq = 0
        self._entries: deque[tuple[int, bool, np.ndarray]] = deque()  # (seq after it, added?, keys)
        self._kept = 0

    def record(self, added: bool, keys: np.ndarray) -> None:
        if not len(keys):
            return
        self.seq += 1
        self._entries.append((self.seq, added, np.asarray(keys, dtype=np.uint64)))
        self._kept += len(keys)
        while self._kept > self.keep and self._entries:
            self._kept -= len(self._entries.popleft()[2])

    def since(self, seq: "int | None") -> "Changes | None":
        """The changes after `seq`, in order, as one batch; None when the reader must start
        from the whole contents (it saw nothing, is ahead of us, or fell behind what is kept)."""
        if seq is None or seq > self.seq:
            return None
        oldest = self._entries[0][0] if self._entries else self.seq + 1
        if seq < oldest - 1:
            return None
        events = [(added, keys) for s, added, keys in self._entries if s > seq]
        if not events:
            return Changes(self.seq, np.zeros(0, np.uint64), np.zeros(0, np.uint64))
        keys = np.concatenate([k for _, k in events])
        adds = np.concatenate([np.full(len(k), added) for added, k in events])
        last, at = np.unique(keys[::-1], return_index=True)  # each key's last change
        final = adds[::-1][at]
        return Changes(self.seq, last[final], last[~final])
