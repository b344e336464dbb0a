"""What a sender knows of one receiver: a connected link, its buffers, its staging area."""

from collections.abc import Mapping
from dataclasses import dataclass

from transfer.buffers import Buffer
from kvpool.geometry import Component
from transfer.endpoint import StagingInfo
from transfer.tokens import Lane
from transfer.transports.base import Link


@dataclass(frozen=True)
class RemotePool:
    link: Link                           # the transport picked for this peer, connected
    buffers: tuple[Buffer, ...]          # the receiver's pool buffers (regions 0..n-1)
    staging: StagingInfo | None = None   # the receiver's staging area (None: direct only)
    # by lane (transfer.reshard), when its page size or TP size is not ours: its lanes, ours
    # paired with them (lane i with lane i), and whether they are TP slices
    lanes: Mapping[Component, tuple[Lane, ...]] | None = None
    src_lanes: Mapping[Component, tuple[Lane, ...]] | None = None
    sliced: bool = False
    page_size: int | None = None         # its pool's page size (None: the sender's)

    def slot_offset(self, slot: int) -> int:
        return slot * self.staging.slot_bytes
