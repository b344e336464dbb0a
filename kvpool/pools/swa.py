r"""SWA pool: K/V of the sliding-window layers in its own, smaller page pool.

Window math for a request of L tokens, window W, page size P (s = max(0, L - W)):

    tokens     0 ........ s ............ L
    pages      | 0 | 1 | 2 | 3 | 4 | 5 |        page i covers tokens [iP, (i+1)P)
               \_ out of window _/\_ window _/   window = pages [s // P, ceil(L / P))

Pages before s // P hold no token inside the window and can be evicted; the window pages
are what a transfer moves.
"""

import numpy as np

from kvpool.allocator.swa import SWAAllocator
from kvpool.config import PoolConfig
from kvpool.errors import KVPoolError
from kvpool.geometry import Component
from kvpool.indices import SENTINEL
from kvpool.pools.base import ComponentPool
from kvpool.request import RequestKV


def window_first_page(num_tokens: int, window: int, page_size: int) -> int:
    """Position of the first page that holds a token inside the window."""
    return max(0, num_tokens - window) // page_size


class SWAPool(ComponentPool):
    component = Component.SWA

    def __init__(self, config: PoolConfig, num_items: int, swa_map: SWAAllocator | None = None):
        super().__init__(config, num_items, swa_map)
        if swa_map is None:
            raise KVPoolError("an SWA pool needs the full -> SWA page map")
        self.allocator = swa_map
        self.window = config.model.swa.window

    def held(self, req: RequestKV) -> tuple[np.ndarray, np.ndarray]:
        """The window pages it reads (a shared page before its window may keep an SWA page
        for the cache: not the request's)."""
        swa_pages = self.allocator.translate(req.full_pages[req.swa_evicted :])
        positions = np.flatnonzero(swa_pages != SENTINEL).astype(np.int32)
        return positions + req.swa_evicted, swa_pages[positions]

    def transfer_indices(self, req: RequestKV) -> np.ndarray:
        first = window_first_page(req.num_tokens, self.window, self.config.page_size)
        swa_pages = self.allocator.translate(req.full_pages[first:])
        if (swa_pages == SENTINEL).any():
            raise KVPoolError(f"swa window pages of a {req.num_tokens}-token request were evicted")
        return swa_pages
