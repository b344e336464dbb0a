"""A request's allocation in a hybrid pool: the one handle every pool method takes.

Every per-request index (full pages, state slot, aux row; SWA pages through the allocator's
mapping) lives here, so a new kind of index is a new field, never a new keyword argument
that some pool class forgets to accept.
"""

from dataclasses import dataclass

import numpy as np


@dataclass(eq=False)
class RequestKV:
    num_tokens: int
    full_pages: np.ndarray   # int32 [ceil(num_tokens / page_size)], read-only, no sentinel
    state_slot: int          # MAMBA slot; 0 (sentinel) when the model has no linear layers
    aux_row: int             # AUX row
    freed: bool = False      # set by HybridPool.free_request; every later use is refused

    @property
    def num_pages(self) -> int:
        return len(self.full_pages)
