"""Wire messages: msgspec Structs (msgpack), one tagged union and one decoder per socket.

    bootstrap (REQ -> REP, in the prefill worker or `disagg bootstrap`)
        RegisterPrefill | Lookup          ->  Registered | PrefillInfo | Refused
    control (decode DEALER -> prefill ROUTER, one connection per peer pair)
        to prefill: RegisterDecode | TransferRequest | ChunkDone | Abort | Heartbeat
        to decode:  Registered | Refused | TransferStarted | ChunkLanded | TransferDone | Heartbeat

Every handshake carries PROTOCOL_VERSION; index arrays travel as raw little-endian int32
bytes. Everything decoded here is untrusted: `decode_*` raise ProtocolError with a reason,
and the receivers validate sizes and ranges before they use a value.
"""

import msgspec
import numpy as np

from kvpool.geometry import Component
from kvpool.indices import IndexSet
from kvpool.storage import BufferDescriptor
from transfer.errors import ProtocolError
from transfer.staging import ChunkDone, ChunkLanded
from transfer.wire import WireBuffer, descriptors_from_wire, descriptors_to_wire

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 64 << 20   # larger frames are refused before decoding


class LayoutInfo(msgspec.Struct, frozen=True):
    """What must match between the two sides for a transfer to be meaningful."""
    page_size: int
    layout: str                               # page_major | layer_major
    components: dict[str, list[list]]         # component -> [[layer, part, item_bytes], ...]


# ---- bootstrap ------------------------------------------------------------------------------
class RegisterPrefill(msgspec.Struct, tag=True, frozen=True):
    version: int
    tp_rank: int
    tp_size: int
    control_endpoint: str     # tcp://host:port of the prefill rank's ROUTER
    session_id: str           # Mooncake session host:port
    epoch: int                # instance epoch: new on every start
    layout: LayoutInfo


class Lookup(msgspec.Struct, tag=True, frozen=True):
    version: int
    tp_rank: int = 0


class PrefillInfo(msgspec.Struct, tag=True, frozen=True):
    info: RegisterPrefill


# ---- control --------------------------------------------------------------------------------
class RegisterDecode(msgspec.Struct, tag=True, frozen=True):
    version: int
    epoch: int
    session_id: str
    layout: LayoutInfo
    buffers: list[WireBuffer]
    staging_ptr: int
    staging_slots: int
    staging_slot_bytes: int


class TransferRequest(msgspec.Struct, tag=True, frozen=True):
    room: int
    decode_epoch: int
    num_tokens: int
    indices: dict[str, bytes]   # component -> raw int32 destination indices
    slots: list[int]            # decode staging slots leased to this transfer ([]: direct only)


class TransferStarted(msgspec.Struct, tag=True, frozen=True):
    """Prefill began writing the room's KV (decode: WAITING_FOR_INPUT -> TRANSFERRING)."""
    room: int
    prefill_epoch: int


class TransferDone(msgspec.Struct, tag=True, frozen=True):
    room: int
    prefill_epoch: int
    ok: bool
    reason: str = ""
    nbytes: int = 0
    mode: str = ""
    ranges: int = 0
    transfer_ms: float = 0.0


class Abort(msgspec.Struct, tag=True, frozen=True):
    room: int
    reason: str


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    epoch: int


class Registered(msgspec.Struct, tag=True, frozen=True):
    epoch: int


class Refused(msgspec.Struct, tag=True, frozen=True):
    reason: str


BootstrapRequest = RegisterPrefill | Lookup
BootstrapReply = Registered | PrefillInfo | Refused
ToPrefill = RegisterDecode | TransferRequest | ChunkDone | Abort | Heartbeat
ToDecode = Registered | Refused | TransferStarted | ChunkLanded | TransferDone | Heartbeat

encoder = msgspec.msgpack.Encoder()


class Decoder:
    """One typed decoder per socket; refuses oversized or undecodable frames with a reason."""

    def __init__(self, union, what: str):
        self._decoder = msgspec.msgpack.Decoder(union)
        self.what = what

    def decode(self, frame: bytes):
        if len(frame) > MAX_FRAME_BYTES:
            raise ProtocolError(f"{self.what}: frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
        try:
            return self._decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ProtocolError(f"{self.what}: undecodable frame ({exc})") from None


def check_version(version: int) -> None:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version} != ours ({PROTOCOL_VERSION})")


# ---- conversions ----------------------------------------------------------------------------
to_wire = descriptors_to_wire
from_wire = descriptors_from_wire


def layout_info(page_size: int, layout: str, descs: list[BufferDescriptor]) -> LayoutInfo:
    comps: dict[str, list[list]] = {}
    for d in descs:
        comps.setdefault(d.component.value, []).append([d.layer, d.part, d.item_bytes])
    return LayoutInfo(page_size, layout, comps)


def layout_difference(ours: LayoutInfo, theirs: LayoutInfo) -> str | None:
    """None if a transfer between the two layouts is meaningful, else the first difference."""
    if ours.page_size != theirs.page_size:
        return f"page size {ours.page_size} vs {theirs.page_size}"
    if ours.layout != theirs.layout:
        return f"pool layout {ours.layout} vs {theirs.layout}"
    if set(ours.components) != set(theirs.components):
        return f"components {sorted(ours.components)} vs {sorted(theirs.components)}"
    for c in ours.components:
        a, b = ours.components[c], theirs.components[c]
        if len(a) != len(b):
            return f"{c}: {len(a)} buffers vs {len(b)}"
        for x, y in zip(a, b):
            if list(x) != list(y):  # [layer, part, bytes per item]; theirs may be malformed: no indexing
                return f"{c}: buffer {list(x)} vs {list(y)} ([layer, part, bytes per item])"
    return None


def indices_to_wire(iset: IndexSet) -> dict[str, bytes]:
    return {c.value: np.ascontiguousarray(iset[c], dtype="<i4").tobytes() for c in iset.components()}


def indices_from_wire(raw: dict[str, bytes]) -> IndexSet:
    out = {}
    for name, data in raw.items():
        try:
            component = Component(name)
        except ValueError:
            raise ProtocolError(f"unknown component {name!r} in indices") from None
        if len(data) % 4:
            raise ProtocolError(f"{name}: {len(data)} bytes is not a whole number of int32 indices")
        arr = np.frombuffer(data, dtype="<i4").astype(np.int32)
        arr.setflags(write=False)
        out[component] = arr
    return IndexSet(out)
