"""CacheIndex: the router's copy of what every worker rank's prefix cache holds, by chained page
key, and how much of a prompt an instance holds (`--route kv`, disagg/router/scoring.py).

    worker rank ── POST /cache/events {"since": seq, "epoch": E} ──> changes since seq
                                                   (or all, a reset: new reader, restarted rank)
        asked by the monitor's rounds (every probe_every_s) and right after a request the
        router sent there ended, so the next turn of a conversation sees this one's pages

Why a pull of journalled changes (kvpool.cache.journal), not pushed events or a summary in
/health: it reuses the worker HTTP the router already polls (no new socket or listener, no
key for the router to hold), costs what changed rather than the cache's size, a worker that
restarted (new epoch) or a router that fell behind gets the whole contents once, and the
router sees a request's own pages as soon as it ends. A rank is looked up by computing the
prompt's chained keys at that rank's page size (kvpool.cache.blocks.chain_keys) and counting
how many leading ones it holds; an instance holds what its every rank holds (TP: each rank's
cache is its own).

Every answer is untrusted (disagg/control/cache_events.py): one that is malformed, too large,
of another epoch without a reset, or older than what we have is refused whole, logged at
WARNING (once until that rank answers well again), and changes nothing; the next poll asks that rank for its
whole contents. A rank without a cache (404) has none in the index.
"""

import http.client
import json
import logging
import threading
import urllib.error
import urllib.request

import numpy as np

from disagg.control.cache_events import MAX_BYTES, MAX_KEYS, CacheEvents, CacheEventsError, decode_events
from kvpool.cache.blocks import chain_keys

log = logging.getLogger(__name__)


class RankCache:
    """One rank's cached keys as its accepted answers said."""

    def __init__(self, max_keys: int = MAX_KEYS):
        self.max_keys = max_keys
        self.epoch: int | None = None
        self.seq: int | None = None  # None: ask for the whole contents next
        self.page_size: int | None = None
        self.align: int | None = None  # a hit is a multiple of it, tokens (None: the page)
        self.keys: set[int] = set()
        self.lock = threading.Lock()  # keys vs lookups; polls of one rank are serialized by the index

    def apply(self, ev: CacheEvents, asked: "int | None") -> None:
        """Take an answer to a poll that sent `since=asked`, whole, or CacheEventsError and
        nothing changed."""
        if not ev.reset:
            if asked is None or self.epoch is None:
                raise CacheEventsError("changes without a reset, to a poll that asked for everything")
            if ev.epoch != self.epoch or ev.page_size != self.page_size:
                raise CacheEventsError(
                    f"changes of epoch {ev.epoch} page size {ev.page_size} without a reset "
                    f"(we hold epoch {self.epoch}, page size {self.page_size})"
                )
            if ev.seq < asked:
                raise CacheEventsError(f"seq {ev.seq} is before the {asked} we asked from")
        size = len(ev.added) if ev.reset else len(self.keys) + len(ev.added)
        if size > self.max_keys:
            raise CacheEventsError(f"{size} keys, more than the {self.max_keys} kept per rank")
        with self.lock:
            if ev.reset:
                self.keys = set(ev.added)
            else:
                self.keys.difference_update(ev.evicted)
                self.keys.update(ev.added)
            self.epoch, self.seq, self.page_size, self.align = ev.epoch, ev.seq, ev.page_size, ev.align

    def usable(self, chain: np.ndarray) -> int:
        """How many tokens of a prompt (its `chain` of keys at our page size, capped) the rank
        would take: the leading keys it holds, cut to a multiple of its align."""
        held = self.held_pages(chain) * self.page_size
        return held - held % (self.align or self.page_size)

    def held_pages(self, chain: np.ndarray) -> int:
        """How many leading keys of `chain` (a prompt's, at our page size) we hold."""
        with self.lock:
            for i, key in enumerate(chain.tolist()):
                if key not in self.keys:
                    return i
            return len(chain)


class CacheIndex:
    def __init__(self, timeout_s: float = 2.0, max_keys: int = MAX_KEYS):
        self.timeout_s, self.max_keys = timeout_s, max_keys
        self._ranks: dict[str, RankCache] = {}
        self._polling: dict[str, threading.Lock] = {}
        self._refused: dict[str, str] = {}  # url -> why its last answer was refused (logged once)
        self._lock = threading.Lock()

    def poll(self, url: str) -> None:
        """Bring one rank's copy up to date (never raises: a rank that cannot be reached keeps
        what it had; the monitor routes around a rank that is down)."""
        with self._lock:
            polling = self._polling.setdefault(url, threading.Lock())
        with polling:
            with self._lock:
                rank = self._ranks.get(url)
            asked = rank.seq if rank is not None else None
            status, raw = self._post(url, asked, rank.epoch if rank is not None else None)
            if status == 404:  # this rank keeps no cache
                with self._lock:
                    self._ranks.pop(url, None)
                return
            if status != 200:
                return
            rank = rank if rank is not None else RankCache(self.max_keys)
            try:
                rank.apply(decode_events(raw), asked)
            except CacheEventsError as exc:
                self._refuse(url, rank, str(exc))
                return
            with self._lock:
                self._ranks[url] = rank
                self._refused.pop(url, None)

    def _refuse(self, url: str, rank: RankCache, why: str) -> None:
        rank.seq = None  # ask for the whole contents next time; keep what we have meanwhile
        with self._lock:
            said, self._refused[url] = self._refused.get(url), why
        if said is None:  # once until the rank answers well again
            log.warning("cache index: %s/cache/events refused (nothing changed): %s", url, why)

    def _post(self, url: str, since: "int | None", epoch: "int | None") -> tuple[int, bytes]:
        body = json.dumps({"since": since, "epoch": epoch}).encode()
        req = urllib.request.Request(url + "/cache/events", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read(MAX_BYTES + 1)
        except urllib.error.HTTPError as exc:
            return exc.code, b""
        except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError):
            return 0, b""

    def forget(self, urls) -> None:
        """Ranks the router no longer serves."""
        with self._lock:
            for url in urls:
                self._ranks.pop(url, None)
                self._polling.pop(url, None)
                self._refused.pop(url, None)

    def cached_tokens(
        self, urls: "tuple[str, ...]", tokens: np.ndarray, chains: "dict[int, np.ndarray] | None" = None
    ) -> int:
        """The longest prefix of the prompt every rank of one instance would take, in tokens:
        what it holds, capped where a worker caps a hit ((n - 1) // P * P: prefill computes
        the last token) and cut to the rank's align; 0 when a rank has no cache or no copy yet. `chains` (page size -> the prompt's keys) is filled
        as keys are computed: pass one dict for every instance a request is weighed on."""
        with self._lock:
            ranks = [self._ranks.get(u) for u in urls]
        if not urls or any(r is None or r.page_size is None for r in ranks):
            return 0
        chains = {} if chains is None else chains
        held = []
        for r in ranks:
            page = r.page_size
            if page not in chains:
                chains[page] = chain_keys(tokens, page)[: (len(tokens) - 1) // page].view(np.int64)
            held.append(r.usable(chains[page]))
        return min(held)

    def indexed(self, urls: "tuple[str, ...]") -> bool:
        """Every rank of the instance has a copy in the index (its cached_tokens is a prediction,
        not a 0 for want of one)."""
        with self._lock:
            return bool(urls) and all(u in self._ranks and self._ranks[u].page_size is not None for u in urls)

    def ranks(self) -> dict[str, int]:
        """url -> keys held (for /health and tests)."""
        with self._lock:
            return {u: len(r.keys) for u, r in self._ranks.items()}
