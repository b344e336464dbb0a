"""FULL pool: MHA K/V or MLA latent of the full-attention layers, indexed by full page."""

from kvpool.geometry import Component
from kvpool.pools.base import FullPagePool


class FullPool(FullPagePool):
    component = Component.FULL
