"""Roster: the pairs a router serves now, each with a number that stays its own.

    --pair ...                  fixed for the router's life
    --pairs-file FILE           one --pair value per line ('#' comments); read again whenever it
                                changes (its size or modification time), e.g. a Kubernetes
                                ConfigMap the operator edits as instances come and go

A pair added to the file is probed and then served without a restart; a pair taken out of it
gets no new request (those in flight finish); put back, it has its old number again. A file
that cannot be read, or has a line that is not a pair, is logged (once per change) and the
roster stays as it was: a half-edited file never drops every pair.
"""

import argparse
import logging
import os
import threading

from disagg.router.pairs import Pair

log = logging.getLogger(__name__)


def read_pairs(path: str) -> list[Pair]:
    """The pairs a file names; ValueError naming the first bad line."""
    with open(path, encoding="utf-8") as f:
        text = f.read(1 << 20)
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            pair = Pair.parse(line)
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        if not pair.bootstrap:
            raise ValueError(
                f"{path}:{number}: give the bootstrap decode looks prefill up at (PREFILL_URL,DECODE_URL,BOOTSTRAP)"
            )
        pairs.append(pair)
    return pairs


class Roster:
    def __init__(self, fixed: "tuple[Pair, ...]" = (), path: "str | None" = None):
        self.path = path
        self._ids: dict[Pair, int] = {}
        self._fixed = list(dict.fromkeys(fixed))
        self._current = [(self._id(p), p) for p in self._fixed]
        self._seen: tuple[int, int] | None = None
        self._lock = threading.Lock()
        if path is not None:
            self.reload()

    def _id(self, pair: Pair) -> int:
        return self._ids.setdefault(pair, len(self._ids))

    def current(self) -> list[tuple[int, Pair]]:
        with self._lock:
            return list(self._current)

    def reload(self) -> bool:
        """Read the file again if it changed; True when the pairs changed."""
        if self.path is None:
            return False
        try:
            st = os.stat(self.path)
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._seen:
                return False
            listed = read_pairs(self.path)
        except (OSError, ValueError) as exc:
            if self._seen != (-1, hash(str(exc))):
                log.warning("--pairs-file: %s; serving the pairs as they were", exc)
            self._seen = (-1, hash(str(exc)))
            return False
        with self._lock:
            before = self._current
            self._current = [(self._id(p), p) for p in dict.fromkeys(self._fixed + listed)]
            self._seen = stamp
            changed = before != self._current
        if changed:
            log.info(
                "--pairs-file %s: serving %d pair(s): %s",
                self.path,
                len(self._current),
                "; ".join(f"{i}: {p}" for i, p in self._current),
            )
        return changed
