"""HybridPool: every component of a model on one TP shard, and the request lifecycle.

    alloc_request(n) -> RequestKV ──extend()/evict_swa()──> ... ──free_request()
                              └──retract() -> KVCopy ──restore()──> RequestKV

Every allocation checks all allocators before taking anything, so a request either gets
everything it needs or nothing (OutOfSpace names the component that is short). A request
admitted with `grow_to` (decode: prompt + new tokens) has the pages it will need by then
reserved: nobody else may take them, so its extend() up to there never runs short; a
generation that would outgrow the pool is refused before anything is sent, not mid-decode. The lifecycle
methods hold one lock: servers call them from many threads, and allocators are not
thread-safe on their own.

Full pages have holders: the request that allocated a page, and where a prefix cache keeps
it (kvpool.cache.prefix: `hold` / `drop`), the cache and every request that took it as its
prefix (`alloc_request(prefix=)`). A page (with its SWA page) goes back to the allocator when
its last holder lets go. A request's shared pages are its first `RequestKV.shared` ones: it
only reads them (its KV arrives, and grows, beyond them) and never evicts their SWA pages.
"""

import threading

import numpy as np
import torch

from kvpool.allocator.paged import PagedAllocator, num_pages_for
from kvpool.allocator.slots import SlotAllocator, StateSlotAllocator
from kvpool.allocator.swa import SWAAllocator
from kvpool.components import Component
from kvpool.config import PoolConfig
from kvpool.cpu_copy import KVCopy
from kvpool.errors import AllocatorError, LayoutMismatch, OutOfSpace
from kvpool.indices import INDEX_DTYPE, IndexSet, SENTINEL, as_indices
from kvpool.pools.aux import AuxPool
from kvpool.pools.base import ComponentPool, KVPool
from kvpool.pools.full import FullPool
from kvpool.pools.mamba import MambaPool
from kvpool.pools.nsa import NSAPool
from kvpool.pools.swa import SWAPool, window_first_page
from kvpool.request import RequestKV
from kvpool.storage import BufferDescriptor

# The pool class that keeps each component's items (kvpool.components says what a component
# is; its pool is built on that): one entry per component.
POOL_CLASSES: dict[Component, type[ComponentPool]] = {
    cls.component: cls for cls in (FullPool, SWAPool, NSAPool, MambaPool, AuxPool)
}


class HybridPool(KVPool):
    def __init__(self, config: PoolConfig):
        self._lock = threading.RLock()
        self.config = config
        self.page_size = config.page_size
        self.sizes = sizes = config.sizes()
        comps = config.components
        self.pages = PagedAllocator(sizes.full_pages, config.page_size, "full pages")
        self.swa_allocator = (
            SWAAllocator(self.pages, PagedAllocator(sizes.swa_pages, config.page_size, "swa pages"))
            if Component.SWA in comps
            else None
        )
        self.state_slots = StateSlotAllocator(sizes.state_slots, "mamba slots") if Component.MAMBA in comps else None
        self.aux_rows = StateSlotAllocator(sizes.state_slots, "aux rows")
        self._holders = np.zeros(sizes.full_pages + 1, dtype=np.int32)  # full page -> who holds it
        self._reserved = {id(self.pages): 0}  # allocator -> pages promised to live requests, not yet taken
        if self.swa_allocator is not None:
            self._reserved[id(self.swa_allocator.swa)] = 0
        self.pools: dict[Component, ComponentPool] = {
            c: POOL_CLASSES[c](config, sizes.num_items(c), self.swa_allocator) for c in comps
        }

    @property
    def aux(self) -> AuxPool:
        return self.pools[Component.AUX]

    # ---- request lifecycle ------------------------------------------------------------
    def alloc_request(
        self,
        num_tokens: int,
        swa_window_only: bool = False,
        grow_to: int | None = None,
        prefix: np.ndarray | None = None,
    ) -> RequestKV:
        """Allocate a request of `num_tokens` tokens. With `swa_window_only`, SWA pages back
        only the window (what a decode side receives); otherwise every page (prefill).
        `grow_to`: the most tokens it will be extended to; what it needs by then is reserved.
        `prefix`: full pages someone holds already (a prefix cache's) that become its first
        pages, shared (one more holder each); only the rest is allocated. Those of them in
        the window must have their SWA page."""
        with self._lock:
            if not isinstance(num_tokens, (int, np.integer)) or num_tokens < 1:
                raise AllocatorError(f"a request needs at least one token, got {num_tokens!r}")
            grow_to = self._grow_to(num_tokens, grow_to)
            first = self._window_first(num_tokens) if swa_window_only else 0
            pages = self._check_prefix(prefix, int(num_tokens), first)
            return self._alloc(int(num_tokens), first, grow_to, pages)

    def _check_prefix(self, prefix: np.ndarray | None, num_tokens: int, swa_first: int) -> np.ndarray:
        """`prefix` as int32 pages a request of `num_tokens` may share (held, distinct, fewer
        than its pages, SWA-backed in its window); AllocatorError, nothing changed, otherwise."""
        if prefix is None:
            return np.zeros(0, dtype=INDEX_DTYPE)
        pages = as_indices(prefix, "prefix")
        if len(pages) >= num_pages_for(num_tokens, self.page_size):
            raise AllocatorError(
                f"a prefix of {len(pages)} pages leaves a {num_tokens}-token request no page of its own"
            )
        if len(pages) and (
            pages.min() < 1
            or pages.max() >= len(self._holders)
            or (self._holders[pages] < 1).any()
            or len(np.unique(pages)) != len(pages)
        ):
            raise AllocatorError("prefix pages must be distinct pages someone holds")
        if (
            self.swa_allocator is not None
            and swa_first < len(pages)
            and (self.swa_allocator.translate(pages[swa_first:]) == SENTINEL).any()
        ):
            raise AllocatorError("a prefix page in the request's window has no SWA page")
        return pages

    @staticmethod
    def _grow_to(num_tokens: int, grow_to: int | None) -> int:
        if grow_to is None:
            return int(num_tokens)
        if not isinstance(grow_to, (int, np.integer)) or grow_to < num_tokens:
            raise AllocatorError(f"grow_to must be an int >= the request's {num_tokens} tokens, got {grow_to!r}")
        return int(grow_to)

    def _needs(
        self, num_tokens: int, swa_first: int, grow_to: int | None = None, shared: int = 0
    ) -> list[tuple[SlotAllocator, int, int]]:
        """What a request takes from each allocator now, and what it keeps reserved there until
        it has grown to `grow_to` tokens; SWA pages back [swa_first, num_pages) now, its first
        `shared` pages being someone else's (it takes none for them)."""
        n_pages = num_pages_for(num_tokens, self.page_size)
        later = num_pages_for(grow_to or num_tokens, self.page_size) - n_pages
        needs: list[tuple[SlotAllocator, int, int]] = [(self.pages, n_pages - shared, later), (self.aux_rows, 1, 0)]
        if self.swa_allocator is not None:
            held = n_pages - max(swa_first, shared)
            peak = self._swa_peak(num_tokens, grow_to or num_tokens, held, shared)
            needs.append((self.swa_allocator.swa, held, peak - held))
        if self.state_slots is not None:
            needs.append((self.state_slots, 1, 0))
        return needs

    def _swa_peak(self, num_tokens: int, grow_to: int, held: int, shared: int = 0) -> int:
        """The most SWA pages of its own a request holding `held` at `num_tokens` holds while
        it grows to `grow_to` (extend evicts the pages that left the window before it takes
        new ones; its first `shared` pages are never its own)."""
        if grow_to == num_tokens:
            return held
        t = np.arange(num_tokens + 1, grow_to + 1, dtype=np.int64)
        window = self.config.model.swa.window
        later = -(-t // self.page_size) - np.maximum(shared, np.maximum(0, t - window) // self.page_size)
        return max(held, int(later.max()))

    def fits_when_empty(self, num_tokens: int, swa_window_only: bool = False, grow_to: int | None = None) -> bool:
        """Whether a request of `num_tokens` (growing to `grow_to`) could be allocated at all
        (in the empty pool): False means waiting for space is pointless."""
        return self.shortfall(num_tokens, swa_window_only, grow_to) is None

    def shortfall(self, num_tokens: int, swa_window_only: bool = False, grow_to: int | None = None) -> str | None:
        """Why a request of `num_tokens` (growing to `grow_to`) can never be allocated, naming
        the component that is short (None: it fits the empty pool)."""
        first = self._window_first(num_tokens) if swa_window_only else 0
        for allocator, n, later in self._needs(num_tokens, first, grow_to):
            if n + later > allocator.capacity:
                paged = isinstance(allocator, PagedAllocator)
                held = (
                    f"{allocator.capacity} ({allocator.capacity * self.page_size} tokens)"
                    if paged
                    else str(allocator.capacity)
                )
                return f"the {allocator.name} hold {held} even when empty; this request needs {n + later}"
        return None

    def _free_for(self, allocator: SlotAllocator) -> int:
        """What a new allocation may take from `allocator`: its free items less the promised."""
        return allocator.num_free - self._reserved.get(id(allocator), 0)

    def _promise(self, req: RequestKV) -> tuple[int, int]:
        """(full pages, SWA pages) still reserved for `req`: what it will take by its grow_to."""
        full = max(0, num_pages_for(req.grow_to, self.page_size) - req.num_pages)
        own_swa = req.num_pages - max(req.swa_evicted, req.shared)
        swa = max(0, req.swa_peak - own_swa) if self.swa_allocator is not None else 0
        return full, swa

    def _promised(self, req: RequestKV, before: tuple[int, int]) -> None:
        """Account for the change of req's reservation since `before` (_promise then)."""
        full, swa = self._promise(req)
        self._reserved[id(self.pages)] += full - before[0]
        if self.swa_allocator is not None:
            self._reserved[id(self.swa_allocator.swa)] += swa - before[1]

    def _alloc(
        self, num_tokens: int, swa_first: int, grow_to: int | None = None, prefix: np.ndarray | None = None
    ) -> RequestKV:
        """Allocate; SWA pages back positions [swa_first, num_pages); reserve up to grow_to;
        `prefix` (checked: _check_prefix) are its first pages, shared."""
        prefix = np.zeros(0, dtype=INDEX_DTYPE) if prefix is None else prefix
        shared = len(prefix)
        n_pages = num_pages_for(num_tokens, self.page_size)
        swa_first = swa_first if self.swa_allocator is not None else 0
        needs = self._needs(num_tokens, swa_first, grow_to, shared)
        for allocator, n, later in needs:
            if n + later > self._free_for(allocator):
                raise OutOfSpace(allocator.name, n + later, self._free_for(allocator))
        if self.swa_allocator is not None:
            own = self.swa_allocator.alloc(n_pages - shared, max(0, swa_first - shared))
        else:
            own = self.pages.alloc(n_pages - shared)
        self._holders[own] = 1
        self._holders[prefix] += 1
        slot = int(self.state_slots.alloc(1)[0]) if self.state_slots is not None else SENTINEL
        row = int(self.aux_rows.alloc(1)[0])
        req = RequestKV(
            num_tokens=num_tokens,
            full_pages=np.concatenate([prefix, own]),
            state_slot=slot,
            aux_row=row,
            swa_evicted=swa_first,
        )
        req.shared = shared
        req.grow_to = grow_to or num_tokens
        if self.swa_allocator is not None:
            req.swa_peak = sum(needs[2][1:])
        self._promised(req, (0, 0))
        return req

    def extend(self, req: RequestKV, new_num_tokens: int) -> None:
        """Grow `req` to `new_num_tokens`; new pages get SWA pages and pages that left the
        window give theirs back. Pages reserved for it are its own; beyond its grow_to it takes
        only what nobody was promised. Nothing changes when space is short."""
        with self._lock:
            self._check_live(req)
            if new_num_tokens < req.num_tokens:
                raise AllocatorError(f"cannot shrink a request from {req.num_tokens} to {new_num_tokens} tokens")
            before = self._promise(req)
            n_new = num_pages_for(new_num_tokens, self.page_size) - req.num_pages
            if n_new == 0 and self._window_first(new_num_tokens) <= req.swa_evicted:
                req.num_tokens = int(new_num_tokens)  # same pages, nothing left the window
                return
            free_pages = self._free_for(self.pages) + before[0]
            if n_new > free_pages:
                raise OutOfSpace(self.pages.name, n_new, free_pages)
            if self.swa_allocator is not None:
                swa = self.swa_allocator
                first = self._window_first(new_num_tokens)
                # New pages already out of the window (growth by more than a window) get none.
                new_swa_first = min(n_new, max(0, first - req.num_pages))
                freeable = max(0, min(first, req.num_pages) - max(req.swa_evicted, req.shared))
                free_swa = self._free_for(swa.swa) + before[1] + freeable
                if n_new - new_swa_first > free_swa:
                    raise OutOfSpace(swa.swa.name, n_new - new_swa_first, free_swa)
                self._evict_before(req, min(first, req.num_pages))
                new_pages = swa.alloc(n_new, swa_first=new_swa_first)
                req.swa_evicted = max(req.swa_evicted, first)
            else:
                new_pages = self.pages.alloc(n_new)
            self._holders[new_pages] = 1
            req._append_pages(new_pages)
            req.num_tokens = int(new_num_tokens)
            self._promised(req, before)

    def evict_swa(self, req: RequestKV) -> int:
        """Free the SWA pages of `req` that hold no token in its window; returns how many."""
        with self._lock:
            self._check_live(req)
            if self.swa_allocator is None:
                return 0
            before = self._promise(req)
            freed = self._evict_before(req, self._window_first(req.num_tokens))
            self._promised(req, before)  # (evicted pages it was promised back are reserved again)
            return freed

    def free_request(self, req: RequestKV) -> None:
        """The request lets go of its pages (those nobody else holds go back), slot and row."""
        with self._lock:
            self._check_live(req)
            full, swa = self._promise(req)  # its reservation ends with it
            self._reserved[id(self.pages)] -= full
            if self.swa_allocator is not None:
                self._reserved[id(self.swa_allocator.swa)] -= swa
            self._let_go(req.full_pages)
            if self.state_slots is not None:
                self.state_slots.free(np.array([req.state_slot], dtype=np.int32))
            self.aux_rows.free(np.array([req.aux_row], dtype=np.int32))
            req.freed = True

    def hold(self, pages: np.ndarray) -> None:
        """One more holder (a prefix cache) of held, distinct full pages."""
        with self._lock:
            pages = self._held(pages, "hold")
            self._holders[pages] += 1

    def drop(self, pages: np.ndarray) -> None:
        """A holder (a prefix cache) lets go of `pages`; those nobody holds any more go back."""
        with self._lock:
            self._let_go(self._held(pages, "drop"))

    def _held(self, pages: np.ndarray, what: str) -> np.ndarray:
        pages = self.pages.check_owned(pages, what)  # allocated, distinct, never the sentinel
        if (self._holders[pages] < 1).any():
            raise AllocatorError(f"{what}: a page nobody holds")
        return pages

    def _let_go(self, pages: np.ndarray) -> None:
        """One holder fewer for each of `pages`; free those left with none (and their SWA pages)."""
        self._holders[pages] -= 1
        gone = pages[self._holders[pages] == 0]
        if self.swa_allocator is not None:
            self.swa_allocator.free(gone)
        else:
            self.pages.free(gone)

    def holders(self, pages: np.ndarray) -> np.ndarray:
        """How many hold each of `pages` (tests, accounting)."""
        with self._lock:
            return self._holders[np.asarray(pages, dtype=np.int64)].copy()

    def retract(self, req: RequestKV) -> KVCopy:
        """Copy `req` to CPU memory and free it (preemption)."""
        with self._lock:
            copy = self.get_cpu_copy(req)
            self.free_request(req)
            return copy

    def restore(self, copy: KVCopy) -> RequestKV:
        """Allocate a request shaped like `copy` (same tokens, same SWA pages backed) and load it."""
        with self._lock:
            swa_part = copy.components.get(Component.SWA)
            n_pages = num_pages_for(copy.num_tokens, self.page_size)
            first = n_pages - len(swa_part.positions) if swa_part is not None else 0
            if swa_part is not None and not np.array_equal(swa_part.positions, np.arange(first, n_pages)):
                raise LayoutMismatch("copy's SWA pages are not a suffix of the request")
            req = self._alloc(copy.num_tokens, first)
            loaded = False
            try:
                self.load_cpu_copy(req, copy)
                loaded = True
            finally:
                if not loaded:  # the copy did not fit: give the fresh allocation back
                    self.free_request(req)
            return req

    def _window_first(self, num_tokens: int) -> int:
        if self.swa_allocator is None:
            return 0
        return window_first_page(num_tokens, self.config.model.swa.window, self.page_size)

    def _evict_before(self, req: RequestKV, first: int) -> int:
        """Evict SWA pages at positions [req.swa_evicted, first): O(pages evicted), not
        O(request length), so per-token decode growth stays cheap."""
        if first <= req.swa_evicted:
            return 0
        freed = self.swa_allocator.evict(req.full_pages[max(req.swa_evicted, req.shared) : max(first, req.shared)])
        req.swa_evicted = first
        return freed

    def _check_live(self, req: RequestKV) -> None:
        if req.freed:
            raise AllocatorError("request was already freed")

    # ---- the pool interface -------------------------------------------------------------
    def buffer_descriptors(self) -> list[BufferDescriptor]:
        return [d for pool in self.pools.values() for d in pool.buffer_descriptors()]

    # ---- what a transfer endpoint exposes (transfer.endpoint.ExposedPool) ----
    token_rows = True  # items hold token rows in the model's segment order (transfer.tokens)

    def exposed_tensors(self) -> dict[Component, list[torch.Tensor]]:
        """uint8 [num_items, item_bytes] per buffer and component, for gather and scatter."""
        return {c: p.storage.buffers for c, p in self.pools.items()}

    def exposed_placements(self) -> dict[Component, list[tuple[int, int, int, int]]]:
        """(buffer, layer, offset, bytes) of each layer in an item, for layer-wise streaming."""
        return {
            c: [(pl.buffer, pl.segment.layer, pl.offset, pl.segment.nbytes) for pl in p.storage.packed.placements]
            for c, p in self.pools.items()
        }

    def index_set(self, req: RequestKV) -> IndexSet:
        with self._lock:
            self._check_live(req)
            return IndexSet.merge(pool.index_set(req) for pool in self.pools.values())

    def get_cpu_copy(self, req: RequestKV) -> KVCopy:
        with self._lock:
            self._check_live(req)
            parts = [pool.get_cpu_copy(req) for pool in self.pools.values()]
            return KVCopy(req.num_tokens, {c: p for part in parts for c, p in part.components.items()})

    def load_cpu_copy(self, req: RequestKV, copy: KVCopy) -> None:
        with self._lock:
            self._check_live(req)
            extra = set(copy.components) - set(self.pools)
            if extra:
                raise LayoutMismatch(f"copy has components this pool lacks: {sorted(c.value for c in extra)}")
            items = {c: pool.check_copy(req, copy) for c, pool in self.pools.items()}  # all or nothing
            for c, pool in self.pools.items():
                pool.storage.scatter(items[c], copy.components[c].buffers)

    def layer_view(self, layer: int, part: str) -> torch.Tensor:
        for pool in self.pools.values():
            if pool.storage.has(layer, part):
                return pool.layer_view(layer, part)
        raise LayoutMismatch(f"no component holds layer {layer} part {part!r}")

    # ---- accounting ---------------------------------------------------------------------
    def available(self) -> dict[str, int]:
        """Free capacity per allocator, less what live requests were promised (what a new
        request can take): tokens for page pools, slots otherwise."""
        with self._lock:
            out = {
                "full_tokens": self._free_for(self.pages) * self.page_size,
                "aux_rows": self.aux_rows.available_size(),
            }
            if self.swa_allocator is not None:
                out["swa_tokens"] = self._free_for(self.swa_allocator.swa) * self.page_size
            if self.state_slots is not None:
                out["mamba_slots"] = self.state_slots.available_size()
            return out

    def check_integrity(self) -> None:
        with self._lock:
            (self.swa_allocator or self.pages).check_integrity()
            held = self._holders > 0
            assert not held[0] and (self._holders >= 0).all(), "the sentinel is held, or a page has < 0 holders"
            assert np.array_equal(np.flatnonzero(held).astype(INDEX_DTYPE), self.pages.used()), (
                "pages held and pages allocated disagree"
            )
            if self.state_slots is not None:
                self.state_slots.check_integrity()
            self.aux_rows.check_integrity()
