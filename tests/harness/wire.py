"""Messages of the peer server's two sockets (harness.peer_server), one union and one decoder
each: the command socket (REQ/REP) and the chunk channel (PAIR), which carries the control
plane's own chunk notices; and of the sender server's command socket (harness.sender_server)."""

import msgspec

from disagg.control.messages import ChunkDone, ChunkLanded
from transfer.buffers import Buffer
from transfer.endpoint import StagingInfo
from transfer.report import TransferReport
from transfer.transports import Offer


# ---- command socket: client -> server ------------------------------------------------------
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
    tp_size: int = 1
    tp_rank: int = 0


class Hello(msgspec.Struct, tag=True, frozen=True):
    pass


class Alloc(msgspec.Struct, tag=True, frozen=True):
    num_tokens: int
    window_only: bool = True


class Fragment(msgspec.Struct, tag=True, frozen=True):
    seed: int


class Expect(msgspec.Struct, tag=True, frozen=True):
    transfer_id: int
    req: int
    want_slots: int = 0
    sender: tuple[int, int, int] | None = None  # its (page size, TP size, TP rank); None: ours
    prefix_len: int = 0  # positions the request holds already: a staged piece below them is refused


class Verify(msgspec.Struct, tag=True, frozen=True):
    """Check a request against what the stand-in engine writes for `tokens` (int64 raw) in room `room`."""

    req: int
    tokens: bytes
    room: int


class Fill(msgspec.Struct, tag=True, frozen=True):
    """Write positions [0, upto) of a request's paged components as a decode that cached that
    prefix holds them: the stand-in's bytes for `tokens` (int64 raw), or with `garbage`,
    random bytes (seeded by `room`) that a suffix transfer must leave as they are."""

    req: int
    tokens: bytes
    room: int
    upto: int
    garbage: bool = False


class Release(msgspec.Struct, tag=True, frozen=True):
    transfer_id: int


class Digest(msgspec.Struct, tag=True, frozen=True):
    req: int
    outside: bool = False  # also hash every item the request does not hold (slow on big pools)
    by_token: bool = False  # paged components per token position, not per page (page sizes differ)
    below: int = 0  # > 0: only paged components' positions [0, below) (a prefix held)


class Free(msgspec.Struct, tag=True, frozen=True):
    req: int


class Available(msgspec.Struct, tag=True, frozen=True):
    pass


class Stop(msgspec.Struct, tag=True, frozen=True):
    pass


Command = Configure | Hello | Alloc | Fragment | Expect | Release | Digest | Free | Available | Verify | Fill | Stop


# ---- command socket: server -> client ------------------------------------------------------
class Target(msgspec.Struct, tag=True, frozen=True):
    """What a sender needs to connect to the server's pool."""

    offers: list[Offer]
    buffers: list[Buffer]
    staging: StagingInfo
    page_size: int
    tp_size: int = 1
    tp_rank: int = 0


class Allocated(msgspec.Struct, tag=True, frozen=True):
    id: int
    arrays: dict[str, bytes]  # raw int32


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


# ---- chunk channel ------------------------------------------------------------------------
Chunks = ChunkLanded | ChunkDone


# ---- sender server (harness.sender_server): client -> server, server -> client -------------
class Link(msgspec.Struct, tag=True, frozen=True):
    """Connect to a receiver (its Target), with a chunk channel of its own (`chunks`)."""

    key: int
    target: Target
    chunks: str


class SendTo(msgspec.Struct, frozen=True):
    key: int  # a Link's
    transfer_id: int
    arrays: dict[str, bytes]  # the receiver's indices (raw int32), as Allocated
    slots: list[int]  # its staging slots leased to this transfer


class Prepare(msgspec.Struct, tag=True, frozen=True):
    """Lay out the sends to these receivers as a prefill worker does while the KV computes
    (KVSender.prepare, FanOut.prepare): nothing moves; the next Send of the same receivers
    and indices starts from it (its reports say prepared_ahead)."""

    sends: list[SendTo]


class Send(msgspec.Struct, tag=True, frozen=True):
    """Send the prefilled request to every receiver named, all at once (a thread each)."""

    sends: list[SendTo]


class Sent(msgspec.Struct, tag=True, frozen=True):
    reports: list[TransferReport]  # one per SendTo, in order


SenderCommand = Link | Prepare | Send | Stop
SenderReply = Sent | Ok | Error
