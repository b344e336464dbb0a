"""Messages of the peer server's command socket (transfer.peer_server), one decoder each way,
and the wire form of buffer descriptors (shared with the control plane)."""

import msgspec

from kvpool.geometry import Component
from kvpool.storage import BufferDescriptor
from transfer.errors import ProtocolError
from transfer.peer import PeerTarget


class Hello(msgspec.Struct, tag=True, frozen=True):
    pass


class Configure(msgspec.Struct, tag=True, frozen=True):
    """(Re)build the server's pool and receiver; drops every request of the old pool."""
    preset: str
    page_size: int
    tokens: int
    layout: str = "page_major"
    max_requests: int = 8
    swa_ratio: float = 0.5
    device: str = "cpu"
    staging_slots: int = 4
    staging_slot_bytes: int = 16 << 20


class Alloc(msgspec.Struct, tag=True, frozen=True):
    num_tokens: int
    window_only: bool = True


class Fragment(msgspec.Struct, tag=True, frozen=True):
    seed: int


class Expect(msgspec.Struct, tag=True, frozen=True):
    transfer_id: int
    req: int
    want_slots: int = 0


class Release(msgspec.Struct, tag=True, frozen=True):
    transfer_id: int


class Digest(msgspec.Struct, tag=True, frozen=True):
    req: int
    outside: bool = False   # also hash every item the request does not hold (slow on big pools)


class Free(msgspec.Struct, tag=True, frozen=True):
    req: int


class Available(msgspec.Struct, tag=True, frozen=True):
    pass


class Stop(msgspec.Struct, tag=True, frozen=True):
    pass


Command = Configure | Hello | Alloc | Fragment | Expect | Release | Digest | Free | Available | Stop


class WireBuffer(msgspec.Struct, frozen=True, array_like=True):
    """A BufferDescriptor on the wire (also used by the control plane, disagg.protocol)."""
    ptr: int
    nbytes: int
    item_bytes: int
    component: str
    layer: int | None
    part: str | None


def descriptors_to_wire(descs) -> list[WireBuffer]:
    return [WireBuffer(d.ptr, d.nbytes, d.item_bytes, d.component.value, d.layer, d.part) for d in descs]


def descriptors_from_wire(bufs: list[WireBuffer]) -> list[BufferDescriptor]:
    """Untrusted input: unknown components and impossible sizes raise ProtocolError."""
    out = []
    for b in bufs:
        try:
            component = Component(b.component)
        except ValueError:
            raise ProtocolError(f"unknown component {b.component!r}") from None
        if b.ptr <= 0 or b.nbytes <= 0 or b.item_bytes <= 0 or b.nbytes % b.item_bytes:
            raise ProtocolError(f"bad buffer descriptor {b}")
        out.append(BufferDescriptor(b.ptr, b.nbytes, b.item_bytes, component, b.layer, b.part))
    return out


class Target(msgspec.Struct, tag=True, frozen=True):
    session_id: str
    descriptors: list[WireBuffer]
    staging_ptr: int
    staging_slots: int
    staging_slot_bytes: int


class Allocated(msgspec.Struct, tag=True, frozen=True):
    id: int
    arrays: dict[str, bytes]   # raw int32


class Digests(msgspec.Struct, tag=True, frozen=True):
    per_component: dict[str, str]
    outside: str | None


class Counts(msgspec.Struct, tag=True, frozen=True):
    available: dict[str, int]
    staging_free: int


class Ok(msgspec.Struct, tag=True, frozen=True):
    pass


class Error(msgspec.Struct, tag=True, frozen=True):
    message: str


Reply = Target | Allocated | Digests | Counts | Ok | Error


def target_to_wire(t: PeerTarget) -> Target:
    return Target(t.session_id, descriptors_to_wire(t.descriptors), t.staging_ptr, t.staging_slots,
                  t.staging_slot_bytes)


def target_from_wire(t: Target) -> PeerTarget:
    return PeerTarget(t.session_id, tuple(descriptors_from_wire(t.descriptors)), t.staging_ptr, t.staging_slots,
                      t.staging_slot_bytes)
