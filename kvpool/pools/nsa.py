"""NSA pool: indexer keys (fp8) and scales (fp32) per layer, sharing the full page indices.
One page of one layer holds [page_size, key_dim] keys followed by [page_size, key_dim/128]
scales."""

import numpy as np

from kvpool.geometry import Component
from kvpool.pools.base import ComponentPool
from kvpool.request import RequestKV


class NSAPool(ComponentPool):
    component = Component.NSA

    def held(self, req: RequestKV) -> tuple[np.ndarray, np.ndarray]:
        return np.arange(req.num_pages, dtype=np.int32), req.full_pages

    def transfer_indices(self, req: RequestKV) -> np.ndarray:
        return req.full_pages
