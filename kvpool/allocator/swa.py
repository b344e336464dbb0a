r"""SWA allocator: full pages plus a smaller SWA page pool, tied by a full->SWA page mapping.

    request pages (positions)   0    1    2    3    4    5
    full pages                  17   4    9    30   2    11
    mapping[full page]          0    0    0    6    13   8     <- SWA pages, 0 = none
                                \___ evicted ___/ \__ window __/

Only the mapping says which SWA page backs a full page. Translation is `mapping[pages]`, a
pure function: there is no memo to go stale. mapping[0] == 0, so sentinel padding in a
full-page array translates to sentinel padding in the SWA array.
"""

import numpy as np

from kvpool.allocator.base import Allocator
from kvpool.allocator.paged import PagedAllocator
from kvpool.errors import AllocatorError, OutOfSpace
from kvpool.indices import INDEX_DTYPE, SENTINEL


class SWAAllocator(Allocator):
    def __init__(self, full: PagedAllocator, swa: PagedAllocator):
        if full.page_size != swa.page_size:
            raise AllocatorError(f"full page size {full.page_size} != swa page size {swa.page_size}")
        self.full = full
        self.swa = swa
        self.page_size = full.page_size
        self._mapping = np.zeros(full.num_pages + 1, dtype=INDEX_DTYPE)

    def clear(self) -> None:
        self.full.clear()
        self.swa.clear()
        self._mapping[:] = SENTINEL

    @property
    def mapping(self) -> np.ndarray:
        """Read-only view of the full->SWA page mapping (int32 [num_full_pages + 1])."""
        view = self._mapping.view()
        view.setflags(write=False)
        return view

    def available_size(self) -> int:
        return min(self.full.available_size(), self.swa.available_size())

    def translate(self, full_pages: np.ndarray) -> np.ndarray:
        """SWA pages backing `full_pages` (0 where a page has none or is padding)."""
        pages = np.asarray(full_pages)
        if len(pages) and (pages.min() < 0 or pages.max() > self.full.num_pages):
            raise AllocatorError(f"translate: full pages must lie in [0, {self.full.num_pages}]")
        return self._mapping[pages]

    def alloc(self, num_pages: int, swa_first: int) -> np.ndarray:
        """`num_pages` full pages; SWA pages back positions [swa_first, num_pages) of them
        (earlier positions are out of the window already). Takes nothing unless both pools
        have room."""
        if not 0 <= swa_first <= num_pages:
            raise AllocatorError(f"swa_first {swa_first} outside [0, {num_pages}]")
        n_swa = num_pages - swa_first
        if n_swa > self.swa.num_free:
            raise OutOfSpace(self.swa.name, n_swa, self.swa.num_free)
        full_pages = self.full.alloc(num_pages)
        self._mapping[full_pages[swa_first:]] = self.swa.alloc(n_swa)
        return full_pages

    def free(self, indices: np.ndarray) -> None:
        """Free full pages together with whatever SWA pages still back them."""
        full_pages = self.full.check_owned(indices)
        swa_pages = self._mapping[full_pages]
        self.full._release(full_pages)
        self.swa._release(swa_pages[swa_pages != SENTINEL])  # distinct and allocated by invariant
        self._mapping[full_pages] = SENTINEL

    def evict(self, full_pages: np.ndarray) -> int:
        """Free the SWA pages behind allocated `full_pages` (already evicted ones are skipped);
        the full pages stay. Returns the number of SWA pages freed."""
        pages = self.full.check_owned(full_pages, "evict")
        swa_pages = self._mapping[pages]
        live = swa_pages != SENTINEL
        self.swa._release(swa_pages[live])
        self._mapping[pages[live]] = SENTINEL
        return int(live.sum())

    def check_integrity(self) -> None:
        self.full.check_integrity()
        self.swa.check_integrity()
        m = self._mapping
        assert m[0] == SENTINEL, "mapping of the sentinel page is not the sentinel"
        assert (m[self.full._is_free] == SENTINEL).all(), "a free full page maps to an SWA page"
        backed = m[m != SENTINEL]
        assert len(np.unique(backed)) == len(backed), "two full pages share one SWA page"
        assert np.array_equal(np.sort(backed), self.swa.used()), "mapping and SWA allocator disagree"
