"""KVReceiver: the decode side: slot leases of its endpoint's staging area (the pool and staging
exposed to the transports, transfer.endpoint), and the scatter entry point the control plane
calls when a chunk notice arrives.

Slots are lent per request, to all of its senders at once (`lend`): a sender that moves by
token (another TP size or page size) and gets no slot must go direct, one transport range
per row slice (TP 8 -> 1, gpt-oss-120b: 59,040 ranges of 128 B per sender, 17-20 s over
Mooncake TCP where staged takes 0.1 s), so every sender gets a slot or the request waits for
them; a sender gets no more slots than it has chunks (one 16 MiB slot holds a 1,500-token
sender's share at TP 8 -> 1), and none where it wants none (it said it never stages: it
gathers, TP 1 -> 8; the caller passes its want as 0).
"""

import math

from kvpool.errors import SpecError
from kvpool.indices import IndexSet
from transfer.endpoint import PoolEndpoint
from transfer.errors import LayoutIncompatible, StagingError
from transfer.staging import Piece, scatter
from transfer.reshard import Lanes, Shard, by_token, side_lanes, unpaired
from transfer.tokens import TokenRows


class KVReceiver:
    """Receives into `endpoint`'s pool and staging area, which the caller built and closes
    once no sender writes any more."""

    def __init__(self, endpoint: PoolEndpoint):
        self.endpoint = endpoint
        self.bands: dict = {}  # scatter's bands of our lanes, per lane pairing (a few per sender shard)

    def reserve_slots(self, n: int = 2) -> list[int]:
        """Staging slots for one transfer ([] when all are in use: the sender goes direct)."""
        return self.endpoint.staging.lease.acquire(n, timeout=0.0)

    def lend(self, wants: list[int], timeout: float = 0.0) -> list[list[int]]:
        """Staging slots for a request's senders, `wants[i]` for sender i, taken all at once
        (waiting up to `timeout` seconds for that many to be free: slots come back as other
        requests' senders finish). Wants the area cannot hold at all are cut to one slot per
        sender; when the wait runs out, what is free now is shared, one slot per sender first.
        A sender lent [] goes direct (or gathered); one that wants 0 gets [] and no slot is
        taken for it (none at all, and no wait, when every sender wants 0)."""
        if not any(wants):
            return [[] for _ in wants]
        lease, total = self.endpoint.staging.lease, self.endpoint.staging.num_slots
        if sum(wants) > total:
            wants = [min(w, 1) for w in wants]
        want = min(sum(wants), total)
        got = lease.take(want, timeout) or lease.acquire(want, timeout=0.0)
        out: list[list[int]] = [[] for _ in wants]
        for rnd in range(max(wants, default=0)):  # one slot per sender per round
            for i, w in enumerate(wants):
                if rnd < w and got:
                    out[i].append(got.pop())
        if got:
            lease.release(got)
        return out

    def slots_wanted(self, lanes: Lanes | None, num_tokens: int, most: int, prefix_len: int = 0) -> int:
        """Slots a sender writing by `lanes` (our side, lanes_from; None: whole pages, size
        unknown here) needs for a request of `num_tokens` of which we hold [0, prefix_len)
        already (only the rest moves): one per chunk, at most `most`."""
        if lanes is None:
            return most
        moved = num_tokens - prefix_len
        nbytes = sum(lane.token_bytes * (1 if c.per_request else moved) for c, ls in lanes.items() for lane in ls)
        return max(1, min(most, math.ceil(nbytes / self.endpoint.staging.slot_bytes)))

    def release_slots(self, slots: list[int]) -> None:
        self.endpoint.staging.lease.release(slots)

    def lanes_from(self, sender: Shard) -> Lanes | None:
        """Our side of the lanes a sender of `sender`'s shard writes by (transfer.reshard), the
        ones its by-token pieces name; None when it moves whole pages."""
        pc = self.endpoint.pool.config
        own = pc.shard
        if not by_token(sender, own):
            return None
        why = self.endpoint.no_rows or (self.endpoint.whole_states if sender.tp_size == own.tp_size else "")
        if why:
            raise unpaired(sender, own, why)
        try:
            return side_lanes(pc.model, sender, own, self.endpoint.lanes, 1)  # ours depend on our lanes only
        except SpecError as exc:  # its TP size does not split our model
            raise LayoutIncompatible(f"a sender of TP size {sender.tp_size}: {exc}") from None

    def on_chunk(
        self,
        index: int,
        slot: int,
        pieces: list[Piece],
        dst: IndexSet,
        leased: list[int],
        num_tokens: int,
        *,
        lanes: Lanes | None = None,
        prefix_len: int = 0,
    ) -> None:
        """Scatter chunk `index`, landed in `slot`, into `dst` (the pages of a request of
        `num_tokens`, of which we hold [0, prefix_len) already: never written); `leased` are
        the slots this transfer holds; `lanes`: the sender's pairing (lanes_from), None: our
        own segments whole. Raises StagingError (nothing written) for a notice that does not fit."""
        if slot not in leased:
            raise StagingError(f"chunk {index} names slot {slot}, not leased to this transfer")
        if self.endpoint.faults.hit("recv.chunk"):
            raise StagingError(f"injected fault at recv.chunk (chunk {index})")
        if lanes is None:  # a sender of our TP shard: our paged segments whole
            lanes = {c: l for c, l in self.endpoint.lanes.items() if not c.per_request}
        if len(self.bands) > 64:
            self.bands.clear()
        scatter(
            index,
            slot,
            pieces,
            dst,
            self.endpoint.tensors,
            self.endpoint.staging,
            own=TokenRows(num_tokens, lanes, prefix_len),
            bands=self.bands,
        )
