"""Staging for fragmented transfers: gather -> one large write per chunk -> scatter.

    sender pool pages  --gather (transfer.gather)-->  sender slot  --one transport range-->
    receiver slot      --scatter (index_copy_)-->     receiver pool pages

A plan's (component, buffer) streams are packed into chunks of at most one slot:

    chunk 0: | full buf0 items 0..k | full buf0 items k..n | swa buf0 items 0..m |  <- pieces
    chunk 1: | swa buf0 items m..  | ...

Each chunk notice (the control plane's ChunkLanded) names its pieces (component, buffer,
first item, count, byte offset), so the receiver can validate a notice against its own index
set before copying a byte. Between pools of different page sizes a piece names (lane, first
token position, count) instead and each side finds its own rows (transfer.tokens). Slots on
both sides are leased per transfer (transfer.leases) and always returned.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgspec
import numpy as np
import torch

from kvpool.geometry import Component
from kvpool.host_memory import zeros as host_zeros
from kvpool.indices import IndexSet
from transfer.errors import IndexMismatch, StagingError
from transfer.leases import SlotLease
from transfer.plan import ComponentPlan
from transfer.suffix import Suffix
from transfer.bands import Band, Rows, band_copy, band_index, lane_run, split_rows
from transfer.tokens import Lane, TokenRows, first_covered, rows


class Piece(msgspec.Struct, frozen=True, array_like=True):
    component: str  # Component value
    buffer: int  # index among the component's buffers
    first: int  # first item in the component's aligned index array
    count: int  # items
    offset: int  # byte offset inside the slot
    field_off: int = 0  # only bytes [field_off, field_off + field_len) of each item (a layer group
    field_len: int = 0  # of a page-major row); field_len 0: whole items
    by_token: bool = False  # pools of different page sizes: `buffer` is a lane (segment) of the
    # component and `first` a token position (transfer.tokens)


class ChunkChannel(Protocol):
    """How a staged sender tells the receiver about chunks and hears back (the control plane
    carries these as ChunkLanded / ChunkDone messages)."""

    def notify(self, transfer_id: int, index: int, slot: int, pieces: list[Piece]) -> None:
        """Chunk `index` of the transfer has landed in receiver slot `slot`."""

    def wait_done(self, transfer_id: int, index: int, timeout: float) -> None:
        """Block until the receiver reports chunk `index` (and every earlier one) scattered;
        AckTimeout after `timeout` seconds."""

    def end(self, transfer_id: int) -> None:
        """The transfer is over (done or failed): drop its chunk state."""


@dataclass(frozen=True)
class RemoteSlots:
    """What a staged send may write through: the receiver's staging slots leased to this
    transfer, and the channel its chunk notices and acks go over (`transfer_id` names the
    transfer there)."""

    transfer_id: int
    slots: Sequence[int]
    channel: ChunkChannel | None


@dataclass(frozen=True)
class Chunk:
    pieces: tuple[Piece, ...]
    nbytes: int
    layers_needed: int = 0  # streamed: model layers [0, n) must be final before it is gathered


def chunk_plan(body: Sequence[ComponentPlan], slot_bytes: int) -> list[Chunk]:
    """Pack the body's streams (a plan's, or one layer group's) into chunks of <= slot_bytes
    (loops over streams and chunks, never over items)."""
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    used = 0
    for cp in body:
        n_items = len(cp.src_idx)
        field_off, field_len = cp.field or (0, 0)
        for i, item in enumerate(cp.unit_bytes):
            b = cp.buffer_id(i)
            if item > slot_bytes:
                raise StagingError(f"{cp.component.value} item of {item} bytes exceeds staging slot of {slot_bytes}")
            first = 0
            while first < n_items:
                k = min(n_items - first, (slot_bytes - used) // item)
                if k == 0:
                    chunks.append(Chunk(tuple(pieces), used))
                    pieces, used = [], 0
                    continue
                if cp.by_token:
                    pieces.append(Piece(cp.component.value, b, cp.first_position + first, k, used, by_token=True))
                else:  # `first` counts in the aligned index arrays (a receiver's prefix left out before it)
                    pieces.append(Piece(cp.component.value, b, cp.first_item + first, k, used, field_off, field_len))
                used = min(slot_bytes, _align(used + k * item))
                first += k
    if pieces:
        chunks.append(Chunk(tuple(pieces), used))
    return chunks


PIECE_ALIGN = 16  # piece offsets in a slot, so every piece can be viewed as int64 rows


def _align(n: int) -> int:
    return (n + PIECE_ALIGN - 1) // PIECE_ALIGN * PIECE_ALIGN


def word_rows(t: torch.Tensor, item_bytes: int) -> torch.Tensor:
    """View uint8 rows as the widest integer type dividing the row: torch's index_copy_ moves
    uint8 rows at ~1 GB/s and int64 rows at ~4.5 GB/s on the same CPU."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if item_bytes % dtype.itemsize == 0 and t.data_ptr() % dtype.itemsize == 0:
            return t.view(dtype)
    return t


class StagingArea:
    """num_slots x slot_bytes of one uint8 buffer on `device`, registered once and reused."""

    def __init__(self, num_slots: int, slot_bytes: int, device: str | torch.device):
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.buffer = host_zeros(num_slots * slot_bytes, device)  # (host: huge pages)
        self.lease = SlotLease(num_slots)

    @property
    def ptr(self) -> int:
        return self.buffer.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def slot_offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def slot(self, slot: int) -> torch.Tensor:
        return self.buffer[slot * self.slot_bytes : (slot + 1) * self.slot_bytes]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def field_view(buf: torch.Tensor, p: "Piece") -> torch.Tensor:
    """[items, bytes that move] of a buffer for one piece: the whole rows, or a field of each
    (a strided view: a layer group of page-major rows)."""
    return buf[:, p.field_off : p.field_off + p.field_len] if p.field_len else buf


def _first_item(c: Component, idx: np.ndarray, own: TokenRows | None) -> int:
    """The first of a receiver's indices of c a whole-item piece may write: its own prefix's
    pages are never written (transfer.suffix); page size from its own lanes of c."""
    if own is None or not own.prefix_len or c.per_request or not own.lanes.get(c):
        return 0
    page_size = own.lanes[c][0].page_size
    return Suffix(own.num_tokens, own.prefix_len, page_size).first_item(c, len(idx))


def scatter(
    index: int,
    slot: int,
    pieces: list[Piece],
    dst: IndexSet,
    buffers: dict[Component, list[torch.Tensor]],
    area: StagingArea,
    *,
    own: TokenRows | None = None,
    bands: dict | None = None,
) -> None:
    """Receiver entry point: after chunk `index` has landed in `slot` of `area`, copy its
    pieces into the pool items `dst` names (by-token pieces: the rows of `own`'s lanes; `bands`:
    the caller's cache of those lanes' bands over `buffers`, kept across chunks).
    Every field of the (untrusted) notice is validated first; nothing is written unless all
    pieces are valid."""
    if not 0 <= slot < area.num_slots:
        raise StagingError(f"chunk {index}: slot {slot} outside [0, {area.num_slots})")
    check = _Check(index, dst, buffers, area, own, {} if bands is None else bands)
    copies: list[_RunCopy | _ItemCopy] = []
    i = 0
    while i < len(pieces):
        p = pieces[i]
        try:
            c = Component(p.component)
        except ValueError:
            raise StagingError(f"chunk {index}: unknown component {p.component!r}") from None
        copies.append(check.run(pieces, i, c) if p.by_token else check.item(p, c))
        i += copies[-1].pieces
    data = area.slot(slot)
    for copy in copies:
        copy.write(data)
    for device in {copy.device for copy in copies} | {area.buffer.device}:
        sync(device)


@dataclass(frozen=True)
class _RunCopy:
    """A run of by-token pieces, checked: lanes [k, k + pieces) of one band of our lanes, the
    same rows each, back to back in slot bytes [start, end): one copy per span."""

    band: Band
    k: int
    pieces: int
    rows: np.ndarray
    spans: Rows | None
    start: int
    end: int

    @property
    def device(self) -> torch.device:
        return self.band.buf.device

    def write(self, data: torch.Tensor) -> None:
        band_copy(
            self.band,
            slice(self.k, self.k + self.pieces),
            self.rows,
            self.spans,
            data[self.start : self.end],
            into_pool=True,
        )


@dataclass(frozen=True)
class _ItemCopy:
    """A whole-item piece, checked: the items (or a field of each) of one buffer, one index_copy_."""

    buf: torch.Tensor
    items: np.ndarray
    start: int
    end: int
    pieces = 1

    @property
    def device(self) -> torch.device:
        return self.buf.device

    def write(self, data: torch.Tensor) -> None:
        width = self.buf.shape[1]
        at = torch.from_numpy(self.items.astype(np.int64)).to(self.buf.device)
        src = data[self.start : self.end].view(len(self.items), width).to(self.buf.device)
        word_rows(self.buf, width).index_copy_(0, at, word_rows(src, width))


@dataclass
class _Check:
    """One chunk notice's pieces checked against the receiver's own index set, buffers, lanes
    and slot. A run of by-token pieces one band moves in one go (transfer.bands.lane_run: the
    same positions, the band's next lanes, back to back in the slot) is checked as one: its
    first piece's lane and positions, the run's bytes; every lane of a band is one of ours
    (band_index covers exactly own.lanes[c]). Rows of the same positions are worked out once
    per chunk (TP 8 -> 1: 72 pieces a chunk in two runs, where each piece cost its own)."""

    index: int
    dst: IndexSet
    buffers: dict[Component, list[torch.Tensor]]
    area: StagingArea
    own: TokenRows | None
    bands: dict  # the caller's, kept across chunks and shared by scatter workers
    rows_of: dict = field(default_factory=dict)  # (component, first, count, page size) -> rows, spans

    def run(self, pieces: list[Piece], i: int, c: Component) -> _RunCopy:
        p, own = pieces[i], self.own
        if own is None:
            raise StagingError(
                f"chunk {self.index}: a by-token {p.component} piece, and this pool's page size is the sender's"
            )
        if c not in self.dst:
            raise StagingError(f"chunk {self.index}: no {p.component} pages here")
        lane, rows_, spans = self._token_rows(p, c)
        band_of = self._band_of(c, own.lanes[c])
        band, k, n = lane_run(pieces, i, band_of)
        end = p.offset + n * p.count * lane.token_bytes
        if p.offset < 0 or end > self.area.slot_bytes or p.offset % PIECE_ALIGN:
            raise StagingError(
                f"chunk {self.index}: bytes [{p.offset}, {end}) outside the slot or not {PIECE_ALIGN}-byte aligned"
            )
        return _RunCopy(band, k, n, rows_, spans, p.offset, end)

    def _band_of(self, c: Component, lanes: tuple[Lane, ...]) -> dict:
        """Our lanes' bands (band_index), cached by the lanes' identity: hashing and comparing
        36 lanes per lookup cost more than the run's checks (the entry holds the lanes, so
        their id stays theirs while cached)."""
        entry = self.bands.get((c, id(lanes)))  # (read once: another worker may fill it)
        if entry is None or entry[0] is not lanes:
            entry = self.bands[c, id(lanes)] = lanes, band_index(lanes, self.buffers[c])
        return entry[1]

    def _token_rows(self, p: Piece, c: Component) -> tuple[Lane, np.ndarray, Rows | None]:
        """A by-token piece's lane and positions checked: (lane, rows, rows split in spans).
        `first` is a token position (paged) or an index into the state slots (one row each)."""
        own, lanes_ = self.own, self.own.lanes.get(c, ())
        if not 0 <= p.buffer < len(lanes_):
            raise StagingError(f"chunk {self.index}: no {p.component} lane {p.buffer} here")
        lane, idx = lanes_[p.buffer], self.dst[c]
        key = (c, p.first, p.count, lane.page_size)
        if key in self.rows_of:
            return lane, *self.rows_of[key]
        if c.per_request:
            first, end = 0, len(idx)
        else:
            try:
                first = first_covered(own.num_tokens, lane.page_size, len(idx), "destination", c)
            except IndexMismatch as exc:
                raise StagingError(f"chunk {self.index}: {exc}") from None
            first, end = max(first, own.prefix_len), own.num_tokens  # below: our own prefix, never written
        if p.count < 1 or p.first < first or p.first + p.count > end:
            raise StagingError(
                f"chunk {self.index}: positions [{p.first}, {p.first + p.count}) outside the {p.component} "
                f"positions [{first}, {end}) a transfer writes here"
            )
        if c.per_request:
            rows_ = np.asarray(idx[p.first : p.first + p.count], dtype=np.int64)
        else:
            rows_ = rows(idx, own.num_tokens, lane.page_size, np.arange(p.first, p.first + p.count, dtype=np.int64))
        self.rows_of[key] = rows_, split_rows(rows_, lane.page_size)
        return lane, *self.rows_of[key]

    def item(self, p: Piece, c: Component) -> _ItemCopy:
        buffers, index = self.buffers, self.index
        if c not in self.dst or c not in buffers or not 0 <= p.buffer < len(buffers[c]):
            raise StagingError(f"chunk {index}: no {p.component} buffer {p.buffer} here")
        whole = buffers[c][p.buffer].shape[1]
        if p.field_len and not (0 <= p.field_off and 0 < p.field_len and p.field_off + p.field_len <= whole):
            raise StagingError(
                f"chunk {index}: field [{p.field_off}, {p.field_off + p.field_len}) outside the "
                f"{whole}-byte {p.component} item"
            )
        buf = field_view(buffers[c][p.buffer], p)
        idx, lo = self.dst[c], _first_item(c, self.dst[c], self.own)
        if p.count < 1 or p.first < 0 or p.first + p.count > len(idx):
            raise StagingError(
                f"chunk {index}: items [{p.first}, {p.first + p.count}) outside "
                f"{len(idx)} {p.component} destination indices"
            )
        if p.first < lo:
            raise StagingError(
                f"chunk {index}: items [{p.first}, {p.first + p.count}) of {p.component} write pages "
                f"of the prefix held here (its indices [0, {lo}))"
            )
        end = p.offset + p.count * buf.shape[1]
        if p.offset < 0 or end > self.area.slot_bytes:
            raise StagingError(f"chunk {index}: bytes [{p.offset}, {end}) outside the slot")
        return _ItemCopy(buf, idx[p.first : p.first + p.count], p.offset, end)
