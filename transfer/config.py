"""TransferConfig: one frozen set of knobs for the data path."""

from dataclasses import dataclass, field
from enum import Enum

from transfer.faults import FaultPlan


class Mode(str, Enum):
    AUTO = "auto"  # pick per request with the cost model (transfer.cost)
    DIRECT = "direct"  # one transport range per (run of pages, buffer)
    STAGED = "staged"  # gather -> one large write per chunk -> scatter on the receiver
    GATHERED = "gathered"  # gather into an image of the receiver's pages -> a range per run of them


@dataclass(frozen=True)
class TransferConfig:
    mode: Mode = Mode.AUTO
    # cost model: the link's own figures come from its transport (Link.cost); these are ours
    copy_gbps: float = 8.0  # gather/scatter memory copy (CPU; far more on GPU)
    per_chunk_us: float = 400.0  # notice + ack round trip per staged chunk
    # staging regions: slots x slot_bytes on each side, registered once and reused
    staging_slots: int = 4
    staging_slot_bytes: int = 16 << 20
    # staged: the bytes of one chunk (<= a slot; 0: a whole slot). A chunk is gathered, written and
    # scattered in turn, so smaller chunks overlap the three; each costs a notice, an ack and a write
    staging_chunk_bytes: int = 0
    staging_device: str | None = None  # None: the pool's device; "cpu" stages a GPU pool via host memory
    chunk_timeout_s: float = 30.0  # staged: longest wait for a receiver slot
    stream_group_ms: float = 2.0  # streamed: a layer group keeps the link busy at least this long
    faults: FaultPlan = field(default_factory=FaultPlan)  # injected failures (tests, soak); none by default

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", Mode(self.mode))
        for name in ("staging_slots", "staging_slot_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.staging_chunk_bytes < 0:
            raise ValueError("staging_chunk_bytes must be >= 0 (0: a whole slot)")
        for name in ("copy_gbps", "per_chunk_us", "chunk_timeout_s", "stream_group_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
