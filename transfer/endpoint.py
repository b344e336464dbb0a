"""PoolEndpoint: a pool registered with an engine, plus its staging area. The sender and the
receiver are both one; close() unregisters what this endpoint registered."""

from kvpool.geometry import Component
from kvpool.pools.hybrid import HybridPool
from transfer.config import TransferConfig
from transfer.faults import FaultInjector
from transfer.engine import MooncakeEngine
from transfer.staging import StagingArea


class PoolEndpoint:
    def __init__(self, engine: MooncakeEngine, pool: HybridPool, config: TransferConfig):
        self.engine, self.pool, self.config = engine, pool, config
        self.staging = StagingArea(config.staging_slots, config.staging_slot_bytes,
                                   config.staging_device or pool.config.device)
        self._registered = engine.register([(d.ptr, d.nbytes) for d in pool.buffer_descriptors()]
                                           + [(self.staging.ptr, self.staging.nbytes)])
        self.buffers: dict[Component, list] = {c: p.storage.buffers for c, p in pool.pools.items()}
        self.faults = FaultInjector(config.faults)

    def close(self) -> None:
        """Unregister what this endpoint registered (its staging area, and the pool's buffers
        unless someone registered them before). Call before the pool's memory is freed."""
        if self._registered:
            self.engine.unregister(self._registered)
            self._registered = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
