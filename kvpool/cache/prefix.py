r"""PrefixCache: a worker's own KV of finished requests, reused as the prefix of new ones
(decode: what it need not receive; prefill: what it need not compute).

    admit(tokens) ── match the longest cached prefix (whole pages, capped) ──> Hit (held)
         └── pool.alloc_request(prefix=hit pages): only the rest is allocated; short of
             room: evict least-recently-used pages nobody uses, and try again
    release(kv, hit, tokens)  a request that ended well: its whole pages join the tree
                              (tokens=None: it failed; nothing of its own is kept)

The one owner of the radix tree (kvpool.cache.tree) and of the holds it has on pool pages
(HybridPool.hold / drop): every page in the tree has the cache as a holder, and a request
that takes a prefix holds its pages too, so neither frees the other's.

What decode must hold of a prefix of `p` tokens for a prompt of `n` (transfer.suffix):
    FULL, MLA, NSA   positions [0, p): the tree's full pages (the NSA rows live on them)
    SWA              the window positions below p, [n - W, p): SWA pages of the tree's pages
                     there. The pages at a finished request's end keep theirs (its window),
                     so the hit is cut back to the first page in the new window that has none.
    MAMBA / GDN      nothing: the state at the prompt's end always comes whole from prefill
                     (it computes the whole prompt), so no snapshot is kept here.
    AUX              the request's own row.
The hit leaves prefill at least the prompt's last token to compute (p <= (n - 1) // P * P).

On prefill (`window_only=False`: a request holds the SWA pages of every position, so every
cached page has its own), the hit is also a multiple of `align` tokens: the model engine
computes prompts in passes at multiples of its chunk, and a computation that resumes after
the hit must start where a pass of the whole prompt starts (disagg.engine.model.reuse).

What it holds is published by chained page key (kvpool.cache.blocks.chain_keys: a page's key
covers its whole prefix, so anyone with the token ids can look a prompt up): every page kept
or evicted is a journal entry (kvpool.cache.journal), and `published(since)` answers a reader
with what changed since it last looked, or everything when it is new or fell behind.
"""

import math
import threading
from dataclasses import dataclass

import numpy as np

from kvpool.cache.blocks import chain_keys
from kvpool.cache.journal import Journal
from kvpool.cache.tree import Match, RadixTree
from kvpool.components import SPECS
from kvpool.errors import AllocatorError, OutOfSpace
from kvpool.indices import SENTINEL
from kvpool.pools.hybrid import HybridPool
from kvpool.pools.swa import window_first_page
from kvpool.positions import paged_components
from kvpool.request import RequestKV


@dataclass(frozen=True)
class Hit:
    """The cached prefix a request took: positions [0, prefix_len) on `match.pages`."""

    match: Match
    prefix_len: int


class PrefixCache:
    def __init__(self, pool: HybridPool, *, window_only: bool = True, align: int = 1):
        """window_only: requests hold SWA pages for the window only (decode), else for every
        position (prefill); align: a hit's length is a multiple of it (tokens)."""
        if not isinstance(align, int) or align < 1:
            raise AllocatorError(f"align must be a positive number of tokens, got {align!r}")
        self.pool = pool
        self.page_size = pool.page_size
        self.window_only = window_only
        self._step = math.lcm(align, pool.page_size) // pool.page_size  # a hit is a multiple of these pages
        self.tree = RadixTree(pool.page_size)
        self._lock = threading.Lock()
        self.hit_tokens = 0  # prefix positions requests took (cumulative)
        self.evicted_pages = 0  # pages evicted to make room (cumulative)
        self.journal = Journal()
        self._chain = np.zeros(pool.pages.num_pages + 1, np.uint64)  # cached page -> its chained key

    # ---- a request's life ---------------------------------------------------------------------
    def admit(self, tokens: np.ndarray, grow_to: int | None = None) -> tuple[RequestKV, Hit]:
        """Allocate a request for the prompt `tokens` (decode: the SWA window only) on its
        longest usable cached prefix, evicting what nobody uses when the pool is short.
        OutOfSpace (nothing held) when even that leaves too little."""
        with self._lock:
            hit = self._lookup(np.asarray(tokens, dtype=np.int64))
            self.tree.acquire(hit.match.node)
            try:
                kv = self._alloc(len(tokens), grow_to, hit.match.pages)
            except BaseException:
                self.tree.release(hit.match.node)
                raise
            self.hit_tokens += hit.prefix_len
            return kv, hit

    def release(self, kv: RequestKV, hit: Hit, tokens: np.ndarray | None = None) -> None:
        """The request ended: with `tokens` (the ids of its positions [0, len(tokens)), at most
        kv.num_tokens, whose KV it holds complete and may be reused), the whole pages among
        them are cached; without (it failed), none of its own are. Then it lets go of its pages."""
        with self._lock:
            try:
                if tokens is not None:
                    self._keep(kv, np.asarray(tokens, dtype=np.int64))
            finally:
                self.tree.release(hit.match.node)
                self.pool.free_request(kv)

    def drop(self) -> int:
        """Evict every page no request uses; returns how many."""
        with self._lock:
            pages = self.tree.evict(self.tree.num_pages)
            self._dropped(pages)
            return len(pages)

    # ---- inside -------------------------------------------------------------------------------
    def _lookup(self, tokens: np.ndarray) -> Hit:
        n, page = len(tokens), self.page_size
        match = self.tree.match(tokens, (n - 1) // page)
        usable = self._swa_usable(match, n)
        usable -= usable % self._step
        if usable < match.num_pages:
            match = self.tree.match(tokens, usable)
        return Hit(match, match.num_pages * page)

    def _swa_usable(self, match: Match, n: int) -> int:
        """How many of the matched pages a prompt of n may take: up to the first one in its
        window without an SWA page (those below the window need none; with window_only False
        every page needs its own)."""
        swa = self.pool.swa_allocator
        if swa is None:
            return match.num_pages
        first = window_first_page(n, self.pool.config.model.swa.window, self.page_size) if self.window_only else 0
        backed = swa.translate(match.pages[first:]) != SENTINEL
        return match.num_pages if backed.all() else first + int(np.argmin(backed))

    def _alloc(self, n: int, grow_to: int | None, prefix: np.ndarray) -> RequestKV:
        while True:
            try:
                return self.pool.alloc_request(n, swa_window_only=self.window_only, grow_to=grow_to, prefix=prefix)
            except OutOfSpace as exc:
                if not self._evict_for(exc):
                    raise

    def _evict_for(self, short: OutOfSpace) -> bool:
        """Evict towards what `short` lacks (full pages, or SWA pages: pages that have one);
        False when the cache cannot help (another allocator, or nothing unused)."""
        swa = self.pool.swa_allocator
        if short.component == self.pool.pages.name:
            helps = None
        elif swa is not None and short.component == swa.swa.name:

            def helps(pages):
                return swa.translate(pages) != SENTINEL
        else:
            return False
        pages = self.tree.evict(max(1, short.needed - short.available), helps)
        if not len(pages):
            return False
        self._dropped(pages)
        self.evicted_pages += len(pages)
        return True

    def _dropped(self, pages: np.ndarray) -> None:
        """Pages the tree let go of: the pool's hold goes, and readers hear they left."""
        self.pool.drop(pages)
        self.journal.record(False, self._chain[pages])

    def _keep(self, kv: RequestKV, tokens: np.ndarray) -> None:
        if len(tokens) > kv.num_tokens:
            raise AllocatorError(f"{len(tokens)} token ids for a request holding {kv.num_tokens} positions")
        whole = len(tokens) // self.page_size
        taken = self.tree.insert(tokens[: whole * self.page_size], kv.full_pages[:whole])
        self.pool.hold(taken)
        if len(taken):  # the tree takes a tail: the pages after what it held already
            self._chain[taken] = chain_keys(tokens[: whole * self.page_size], self.page_size)[whole - len(taken) :]
            self.journal.record(True, self._chain[taken])

    # ---- what readers see ---------------------------------------------------------------------
    def published(self, since: "int | None" = None) -> dict:
        """What changed since a reader's `since` (its last `seq`): {"seq", "page_size", "align",
        "reset": False, "added", "evicted"} (chained page keys); or, when it is new or fell behind the
        journal, {"reset": True, "added": every key held}. Keys as Python ints (JSON), each
        uint64 key's bits read as int64 (what JSON decoders bound)."""
        with self._lock:
            changes = self.journal.since(since)
            if changes is None:
                added, evicted = self._chain[self.tree.pages()], np.zeros(0, np.uint64)
            else:
                added, evicted = changes.added, changes.evicted
            return {
                "seq": self.journal.seq,
                "page_size": self.page_size,
                "align": self._step * self.page_size,  # a hit is a multiple of it (tokens)
                "reset": changes is None,
                "added": added.view(np.int64).tolist(),
                "evicted": evicted.view(np.int64).tolist(),
            }

    # ---- accounting ---------------------------------------------------------------------------
    def available(self) -> dict[str, int]:
        """pool.available() with the pages nobody uses counted free: a new request takes them."""
        with self._lock:
            out = self.pool.available()
            unused = self.tree.pages(unused_only=True)
            out["full_tokens"] += len(unused) * self.page_size
            if self.pool.swa_allocator is not None:
                out["swa_tokens"] += int((self.pool.swa_allocator.translate(unused) != SENTINEL).sum()) * self.page_size
            return out

    def stats(self) -> dict[str, int]:
        """For /health and the metrics: what is cached, in use, taken and evicted so far."""
        with self._lock:
            return {
                "cached_tokens": self.tree.num_pages * self.page_size,
                "unused_tokens": len(self.tree.pages(unused_only=True)) * self.page_size,
                "hit_tokens": self.hit_tokens,
                "evicted_tokens": self.evicted_pages * self.page_size,
            }


def reused_bytes(pool: HybridPool, num_tokens: int, prefix_len: int) -> int:
    """The KV bytes of this pool's shard a request of `num_tokens` did not receive because it
    held positions [0, prefix_len): per paged component, the positions of its pages below
    prefix_len (SWA: from the window's first page). Exact where both sides' pages are alike;
    a sender of another page size covers a window from a slightly different position."""
    total, page = 0, pool.page_size
    for c in paged_components(pool):
        first = SPECS[c].first_kept(pool.config.model, num_tokens) // page * page
        below = max(0, prefix_len - first)
        row = sum(buf.shape[1] for buf in pool.pools[c].storage.buffers)  # one item: page_size tokens
        total += below * row // pool.page_size
    return total
