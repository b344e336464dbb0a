"""What a sender knows of a receiver: its session, buffers and staging area."""

from dataclasses import dataclass

from kvpool.storage import BufferDescriptor


@dataclass(frozen=True)
class PeerTarget:
    session_id: str                          # Mooncake session "host:port"
    descriptors: tuple[BufferDescriptor, ...]  # the receiver's pool buffers
    staging_ptr: int = 0                     # the receiver's staging area (0: none)
    staging_slots: int = 0
    staging_slot_bytes: int = 0

    def regions(self) -> list[tuple[int, int]]:
        out = [(d.ptr, d.nbytes) for d in self.descriptors]
        if self.staging_ptr:
            out.append((self.staging_ptr, self.staging_slots * self.staging_slot_bytes))
        return out

    def slot_ptr(self, slot: int) -> int:
        return self.staging_ptr + slot * self.staging_slot_bytes
