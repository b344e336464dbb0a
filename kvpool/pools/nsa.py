"""NSA pool: indexer keys (fp8) and scales (fp32) per layer, sharing the full page indices.
One page of one layer holds [page_size, key_dim] keys followed by [page_size, key_dim/128]
scales."""

from kvpool.geometry import Component
from kvpool.pools.base import FullPagePool


class NSAPool(FullPagePool):
    component = Component.NSA
