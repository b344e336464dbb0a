"""KVReceiver: the decode side: registered pool and staging area, slot leases, and the scatter
entry point the control plane calls when a ChunkLanded notice arrives."""

from kvpool.indices import IndexSet
from transfer.endpoint import PoolEndpoint
from transfer.errors import StagingError
from transfer.peer import PeerTarget
from transfer.staging import ChunkDone, ChunkLanded, scatter


class KVReceiver(PoolEndpoint):
    """Registers its pool and a staging area at construction; close() (or `with`) undoes it."""

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
        if self.faults.hit("recv.chunk"):
            raise StagingError(f"injected fault at recv.chunk (chunk {notice.index})")
        scatter(notice, dst, self.buffers, self.staging)
        return ChunkDone(notice.transfer_id, notice.index)
