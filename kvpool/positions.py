"""Where a token's KV lives, per component: what a model engine needs to read or write one
token, asked of each component's spec (kvpool.components: the SWA translation and window), so
that engines loop over components without naming them.

    position p of a request -> full page req.full_pages[p // page_size], slot p % page_size
    FULL, NSA   item = that full page
    SWA         item = mapping[full page] (SENTINEL once the page left the window)
"""

import numpy as np

from kvpool.components import SPECS, Component
from kvpool.indices import SENTINEL


def paged_components(pool) -> list[Component]:
    """The components of `pool` that hold KV per token (per page), in pool order."""
    return [c for c in pool.pools if not c.per_request]


def state_components(pool) -> list[Component]:
    """The components of `pool` that hold model state per request (not disagg's own record)."""
    return [c for c in pool.pools if c.per_request and not c.metadata]


def token_items(pool, c: Component, req, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(item, slot within the item) of each token position of paged component c; the item is
    SENTINEL where c keeps no page for that position."""
    pages = req.full_pages[positions // pool.page_size]
    return SPECS[c].page_items(pool, pages), positions % pool.page_size


def kept_positions(pool, c: Component, num_tokens: int) -> np.ndarray:
    """The positions of a request of `num_tokens` whose KV a receiver holds for component c,
    whatever the sender's page size (SWA: the window's last `window` tokens, which every
    page size's window pages cover; others: every position)."""
    return np.arange(SPECS[c].first_kept(pool.config.model, num_tokens), num_tokens)


def backed(items: np.ndarray) -> np.ndarray:
    """Mask of the positions whose item is a real page (not the sentinel)."""
    return items != SENTINEL
