"""FULL pool: MHA K/V or MLA latent of the full-attention layers, indexed by full page."""

import numpy as np

from kvpool.geometry import Component
from kvpool.pools.base import ComponentPool
from kvpool.request import RequestKV


class FullPool(ComponentPool):
    component = Component.FULL

    def held(self, req: RequestKV) -> tuple[np.ndarray, np.ndarray]:
        return np.arange(req.num_pages, dtype=np.int32), req.full_pages

    def transfer_indices(self, req: RequestKV) -> np.ndarray:
        return req.full_pages
