"""KVReceiver: the decode side: an exposed pool and staging area, slot leases, and the scatter
entry point the control plane calls when a chunk notice arrives."""

from kvpool.errors import SpecError
from kvpool.indices import IndexSet
from transfer.endpoint import PoolEndpoint
from transfer.errors import LayoutIncompatible, StagingError
from transfer.staging import Piece, scatter
from transfer.reshard import Lanes, Shard, by_token, pair_lanes
from transfer.tokens import TokenRows


class KVReceiver(PoolEndpoint):
    """Exposes its pool and a staging area at construction; close() (or `with`) undoes it."""

    def reserve_slots(self, n: int = 2) -> list[int]:
        """Staging slots for one transfer ([] when all are in use: the sender goes direct)."""
        return self.staging.lease.acquire(n, timeout=0.0)

    def release_slots(self, slots: list[int]) -> None:
        self.staging.lease.release(slots)

    def lanes_from(self, sender: Shard) -> Lanes | None:
        """Our side of the lanes a sender of `sender`'s shard writes by (transfer.reshard), the
        ones its by-token pieces name; None when it moves whole pages."""
        pc = self.pool.config
        own = Shard(pc.page_size, pc.tp_size, pc.tp_rank)
        if not by_token(sender, own):
            return None
        try:
            return pair_lanes(pc.model, sender, own, self.lanes, self.lanes)[1]   # ours depend on our lanes only
        except SpecError as exc:   # its TP size does not split our model
            raise LayoutIncompatible(f"a sender of TP size {sender.tp_size}: {exc}") from None

    def on_chunk(self, index: int, slot: int, pieces: list[Piece], dst: IndexSet, leased: list[int],
                 num_tokens: int, lanes: Lanes | None = None) -> None:
        """Scatter chunk `index`, landed in `slot`, into `dst` (the pages of a request of
        `num_tokens`); `leased` are the slots this transfer holds; `lanes`: the sender's
        pairing (lanes_from), None: our own segments whole. Raises StagingError (nothing
        written) for a notice that does not fit."""
        if slot not in leased:
            raise StagingError(f"chunk {index} names slot {slot}, not leased to this transfer")
        if self.faults.hit("recv.chunk"):
            raise StagingError(f"injected fault at recv.chunk (chunk {index})")
        if lanes is None:   # a sender of our TP shard: our paged segments whole
            lanes = {c: l for c, l in self.lanes.items() if not c.per_request}
        scatter(index, slot, pieces, dst, self.tensors, self.staging, TokenRows(num_tokens, lanes))
