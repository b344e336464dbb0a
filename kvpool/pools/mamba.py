"""MAMBA pool: conv and temporal state of every linear layer, one slot per request."""

import numpy as np

from kvpool.geometry import Component
from kvpool.pools.base import ComponentPool
from kvpool.request import RequestKV


class MambaPool(ComponentPool):
    component = Component.MAMBA

    def held(self, req: RequestKV) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(1, dtype=np.int32), np.array([req.state_slot], dtype=np.int32)

    def transfer_indices(self, req: RequestKV) -> np.ndarray:
        return np.array([req.state_slot], dtype=np.int32)
