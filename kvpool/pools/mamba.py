"""MAMBA pool: conv and temporal state of every linear layer, one slot per request."""

from kvpool.geometry import Component
from kvpool.pools.base import RequestSlotPool
from kvpool.request import RequestKV


class MambaPool(RequestSlotPool):
    component = Component.MAMBA

    def slot(self, req: RequestKV) -> int:
        return req.state_slot
