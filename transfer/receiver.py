"""KVReceiver: the decode side: registered pool and staging area, slot leases, and the scatter
entry point the control plane calls when a ChunkLanded notice arrives."""

from kvpool.geometry import Component
from kvpool.indices import IndexSet
from kvpool.pools.hybrid import HybridPool
from transfer.config import TransferConfig
from transfer.engine import MooncakeEngine
from transfer.errors import StagingError
from transfer.peer import PeerTarget
from transfer.staging import ChunkDone, ChunkLanded, StagingArea, scatter


class KVReceiver:
    def __init__(self, engine: MooncakeEngine, pool: HybridPool, config: TransferConfig):
        self.engine, self.pool, self.config = engine, pool, config
        self.staging = StagingArea(config.staging_slots, config.staging_slot_bytes,
                                   config.staging_device or pool.config.device)
        self._registered = engine.register([(d.ptr, d.nbytes) for d in pool.buffer_descriptors()]
                                           + [(self.staging.ptr, self.staging.nbytes)])
        self.buffers: dict[Component, list] = {c: p.storage.buffers for c, p in pool.pools.items()}

    def close(self) -> None:
        """Unregister what this object registered (its staging area, and the pool's buffers
        unless someone registered them before). Call before the pool's memory is freed."""
        if self._registered:
            self.engine.unregister(self._registered)
            self._registered = []

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def target(self) -> PeerTarget:
        """What a sender needs to write here."""
        return PeerTarget(self.engine.session_id, tuple(self.pool.buffer_descriptors()), self.staging.ptr,
                          self.staging.num_slots, self.staging.slot_bytes)

    def reserve_slots(self, n: int = 2) -> list[int]:
        """Staging slots for one transfer ([] when all are in use: the sender goes direct)."""
        return self.staging.lease.acquire(n, timeout=0.0)

    def release_slots(self, slots: list[int]) -> None:
        self.staging.lease.release(slots)

    def on_chunk(self, notice: ChunkLanded, dst: IndexSet, slots: list[int]) -> ChunkDone:
        """Scatter a landed chunk into `dst`; `slots` are the ones leased to this transfer."""
        if notice.slot not in slots:
            raise StagingError(f"chunk {notice.index} names slot {notice.slot}, not leased to this transfer")
        scatter(notice, dst, self.buffers, self.staging)
        return ChunkDone(notice.transfer_id, notice.index)
