"""Wire messages: msgspec Structs (msgpack), one tagged union and one decoder per socket.

    bootstrap (REQ -> REP, in the prefill worker or `disagg bootstrap`)
        RegisterPrefill | Lookup          ->  Registered | PrefillInfo | Refused
    control (decode DEALER -> prefill ROUTER, one connection per peer pair)
        to prefill: RegisterDecode | TransferRequest | ChunkDone | Abort | Heartbeat
        to decode:  Registered | Refused | TransferStarted | ChunkLanded | TransferDone | Heartbeat

Every handshake carries PROTOCOL_VERSION; index arrays travel as raw little-endian int32
bytes; buffers as (region, size), never addresses; how to reach a side's memory as transport
offers (opaque to the control plane). Everything decoded here is untrusted: decoders raise
ProtocolError with a reason (typed fields, Buffer and StagingInfo check themselves), and the
receivers validate sizes and ranges before they use a value.

A side's LayoutInfo (and the model behind it, for a refusal in words) is in control/layout.py.
"""

from typing import Annotated

import msgspec
import numpy as np

from disagg.control.layout import LayoutInfo
from disagg.errors import ProtocolError
from kvpool.geometry import Component
from kvpool.indices import IndexSet
from transfer.endpoint import StagingInfo
from transfer.report import TransferReport
from transfer.staging import Piece
from transfer.transports import Offer

PROTOCOL_VERSION = 6  # 6: TransferDone carries the digest of the units it sent; 5: TransferRequest.prefix_len;
# 4: TransferDone carries the send's TransferReport, RenewPrefill
MAX_TP_SIZE = 1024
TPSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
TPRank = Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)]
MAX_FRAME_BYTES = 64 << 20  # larger frames are refused before decoding


# ---- bootstrap ------------------------------------------------------------------------------
class RegisterPrefill(msgspec.Struct, tag=True, frozen=True):
    version: int
    tp_rank: int
    tp_size: int
    control_endpoint: str  # tcp://host:port of the prefill rank's ROUTER
    epoch: int  # instance epoch: new on every start
    layout: LayoutInfo


class RenewPrefill(msgspec.Struct, tag=True, frozen=True):
    """A rank's holder renewing its lease (every RENEW_S), or re-claiming it from a bootstrap
    that restarted; RegisterPrefill is a prefill taking a rank at start."""

    info: RegisterPrefill


class Lookup(msgspec.Struct, tag=True, frozen=True):
    version: int
    tp_rank: int = 0


class PrefillInfo(msgspec.Struct, tag=True, frozen=True):
    info: RegisterPrefill


# ---- control --------------------------------------------------------------------------------
class RegisterDecode(msgspec.Struct, tag=True, frozen=True):
    version: int
    epoch: int
    layout: LayoutInfo
    transports: list[Offer]  # how to reach decode's regions, in its order of preference
    staging: StagingInfo | None  # decode's staging area (None: direct writes only)
    tp_size: TPSize = 1  # decode's instance: its ranks, and which one this is (the
    tp_rank: TPRank = 0  # prefill side works out which heads go to it)


class TransferRequest(msgspec.Struct, tag=True, frozen=True):
    """One decode rank's destination for a room: it goes to every prefill rank that holds some
    of that decode rank's heads (transfer.reshard.sends), each with slots of its own."""

    room: int
    decode_epoch: int
    num_tokens: int
    indices: dict[str, bytes]  # component -> raw int32 destination indices (the whole request's)
    slots: list[int]  # decode staging slots leased to this transfer ([]: direct only)
    # the first position decode lacks: it holds [0, prefix_len) already (its cached prefix), and
    # only the rest moves (transfer.suffix). Untrusted: prefill answers TransferDone(fail) for one
    # that is negative, beyond num_tokens or not a multiple of decode's page size.
    prefix_len: int = 0


class TransferStarted(msgspec.Struct, tag=True, frozen=True):
    """Prefill began writing the room's KV (decode: WAITING_FOR_INPUT -> TRANSFERRING)."""

    room: int
    prefill_epoch: int


class TransferDone(msgspec.Struct, tag=True, frozen=True):
    room: int
    prefill_epoch: int
    ok: bool
    reason: str = ""
    report: TransferReport | None = None  # ok: what the send of this decode rank's share did
    # ok: per component, the digest of the units sent to this decode rank, as prefill wrote
    # them (disagg.control.digests: raw records; decode checks what arrived against it)
    digest: dict[str, bytes] = msgspec.field(default_factory=dict)
    # False: prefill gave up on writes its transport may still complete (the peer was lost
    # with writes in flight, transfer.transports.mooncake says why); the pages must not be
    # reused on this word: decode keeps them quarantined and asks again.
    settled: bool = True


class Abort(msgspec.Struct, tag=True, frozen=True):
    room: int
    reason: str


class Heartbeat(msgspec.Struct, tag=True, frozen=True):
    epoch: int


class Registered(msgspec.Struct, tag=True, frozen=True):
    epoch: int
    transport: str = ""  # to RegisterDecode: the transport prefill picked
    # to RegisterDecode: False when this prefill rank never sends that decode rank staged (its
    # mode, or a pairing it always gathers: KVSender.may_stage), so decode lends it no staging
    # slot and never waits for one. Default True: what an older prefill that does not send it
    # meant (an older decode ignores the field).
    may_stage: bool = True


class ChunkLanded(msgspec.Struct, tag=True, frozen=True):
    """Prefill -> decode: staged chunk `index` of room `transfer_id` is in decode slot `slot`."""

    transfer_id: int
    index: int
    slot: int
    pieces: list[Piece]


class ChunkDone(msgspec.Struct, tag=True, frozen=True):
    """Decode -> prefill: chunk `index` was scattered; its slot may be reused."""

    transfer_id: int
    index: int


class Refused(msgspec.Struct, tag=True, frozen=True):
    reason: str


BootstrapRequest = RegisterPrefill | RenewPrefill | Lookup
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
