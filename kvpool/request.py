"""A request's allocation in a hybrid pool: the one handle every pool method takes.

Every per-request index (full pages, state slot, aux row; SWA pages through the allocator's
mapping) lives here, so a new kind of index is a new field, never a new keyword argument
that some pool class forgets to accept. Only HybridPool changes a RequestKV.
"""

import numpy as np

from kvpool.indices import INDEX_DTYPE


class RequestKV:
    def __init__(self, num_tokens: int, full_pages: np.ndarray, state_slot: int, aux_row: int, swa_evicted: int = 0):
        self.num_tokens = num_tokens
        self.state_slot = state_slot  # MAMBA slot; 0 (sentinel) when the model has no linear layers
        self.aux_row = aux_row  # AUX row
        self.swa_evicted = swa_evicted  # pages [0, swa_evicted) hold no SWA page of its own (eviction is a prefix)
        self.shared = 0  # pages [0, shared) are shared (a prefix cache's): it only reads them
        self.freed = False  # set by HybridPool.free_request; every later use is refused
        self.grow_to = num_tokens  # the most tokens it was admitted to grow to (pages reserved up to it)
        self.swa_peak = 0  # the most SWA pages it will hold by then (reserved; 0: none)
        # Page buffer with spare capacity: appending a page per decode step is amortized O(1).
        self._pages = np.array(full_pages, dtype=INDEX_DTYPE)
        self._num_pages = len(self._pages)

    @property
    def full_pages(self) -> np.ndarray:
        """int32 [num_pages], read-only, no sentinel. Arrays handed out earlier stay valid."""
        view = self._pages[: self._num_pages]
        view.flags.writeable = False
        return view

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def _append_pages(self, pages: np.ndarray) -> None:
        need = self._num_pages + len(pages)
        if need > len(self._pages):
            grown = np.zeros(max(need, 2 * len(self._pages), 16), dtype=INDEX_DTYPE)
            grown[: self._num_pages] = self._pages[: self._num_pages]
            self._pages = grown
        self._pages[self._num_pages : need] = pages
        self._num_pages = need

    def __repr__(self) -> str:
        return (
            f"RequestKV(num_tokens={self.num_tokens}, num_pages={self._num_pages}, "
            f"state_slot={self.state_slot}, aux_row={self.aux_row}, freed={self.freed})"
        )
