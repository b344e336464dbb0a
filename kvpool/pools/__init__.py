from kvpool.pools.aux import AuxPool
from kvpool.pools.base import ComponentPool, KVPool
from kvpool.pools.full import FullPool
from kvpool.pools.hybrid import HybridPool
from kvpool.pools.mamba import MambaPool
from kvpool.pools.nsa import NSAPool
from kvpool.pools.swa import SWAPool

__all__ = ["KVPool", "ComponentPool", "FullPool", "SWAPool", "NSAPool", "MambaPool", "AuxPool", "HybridPool"]
