"""The transport interface: how bytes get from this process's memory into a peer's.

    Transport                       one per process and kind (Mooncake, later CUDA IPC, ...)
      expose(regions) -> Exposure   register local memory as numbered regions
        Exposure.offer() -> Offer   what a peer needs to reach them: kind, host, opaque blob
      connect(offer, exposure) -> Link
        Link.write_async(ranges)    (local region, offset) -> (peer region, offset), length
          -> PendingWrite           pollable; wait() sleeps, never spins
        Link.write_runs(runsets)    the same, factorized (runs x buffer pairs); a transport
                                    that can expand on its own device overrides it
        Link.probe(), Link.close()
        Link.cost                   the per-range / per-byte figures the planner's
                                    direct-vs-staged choice needs

Offsets into numbered regions travel, never addresses: a transport that maps the peer's
memory at another address (CUDA IPC) works unchanged. A link checks every range against
the region sizes the peer offered before it writes.
"""

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from transfer.errors import OutOfBounds, TransferError, WriteFailed, WritesAbandoned


class Offer(msgspec.Struct, frozen=True, array_like=True):
    """One way to reach a side's exposed regions (it travels in the registration)."""
    kind: str        # transport name in the registry
    host: str        # host identity: same-host transports only connect where this matches
    blob: bytes      # the transport's own reachability data (opaque to everyone else)


@dataclass(frozen=True)
class LinkCost:
    per_range_us: float   # cost of each separate byte range
    link_gbps: float      # one large write


@dataclass(frozen=True)
class Ranges:
    """Byte ranges to write, vectorized: range i copies length[i] bytes from local region
    src_region[i] at src_off[i] to peer region dst_region[i] at dst_off[i]."""
    src_region: np.ndarray   # int64 [n]
    src_off: np.ndarray      # int64 [n]
    dst_region: np.ndarray   # int64 [n]
    dst_off: np.ndarray      # int64 [n]
    length: np.ndarray       # int64 [n] bytes

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum()) if len(self.length) else 0

    @staticmethod
    def one(src_region: int, src_off: int, dst_region: int, dst_off: int, length: int) -> "Ranges":
        return Ranges(*(np.array([v], dtype=np.int64) for v in (src_region, src_off, dst_region, dst_off, length)))

    @staticmethod
    def concat(parts: Sequence["Ranges"]) -> "Ranges":
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return Ranges(empty, empty, empty, empty, empty)
        return Ranges(*(np.concatenate([getattr(p, f) for p in parts])
                        for f in ("src_region", "src_off", "dst_region", "dst_off", "length")))


@dataclass(frozen=True)
class RunSet:
    """Ranges factorized as the planner produces them: every run copied once per buffer pair.
    Range (b, r) copies count[r] * item_bytes[b] bytes from local region src_region[b] at
    src_start[r] * item_bytes[b] to peer region dst_region[b] at dst_start[r] * item_bytes[b].
    A layer-major page-1 request is millions of ranges but only runs + buffers here.

    With a field (one layer group of a page-major row, for layer-wise streaming) only bytes
    [field_off[b], field_off[b] + field_len[b]) of each item move, so a run of count items is
    count fragments, one per item:

        item:   |<-------------- item_bytes[b] -------------->|
                | L0.k | L0.v | L1.k | L1.v | L2.k | L2.v | ... |
                       |<- field_len ->|
                field_off
    """
    src_start: np.ndarray    # int64 [n_runs] items
    dst_start: np.ndarray    # int64 [n_runs] items
    count: np.ndarray        # int64 [n_runs] items
    src_region: np.ndarray   # int64 [n_bufs]
    dst_region: np.ndarray   # int64 [n_bufs]
    item_bytes: np.ndarray   # int64 [n_bufs]: the item pitch of each buffer (both sides)
    field_off: np.ndarray | None = None   # int64 [n_bufs]: bytes into each item (None: whole items)
    field_len: np.ndarray | None = None   # int64 [n_bufs]: bytes of each item that move

    def __post_init__(self) -> None:
        if (self.field_off is None) != (self.field_len is None):
            raise ValueError("a field needs both its offset and its length")
        if self.fielded and ((self.field_off < 0) | (self.field_len <= 0)
                             | (self.field_off + self.field_len > self.item_bytes)).any():
            raise OutOfBounds("a field lies outside its item")

    @property
    def fielded(self) -> bool:
        return self.field_off is not None

    def __len__(self) -> int:
        """Separate byte ranges (a field makes one per item)."""
        if self.fielded:
            return int(self.count.sum()) * len(self.item_bytes)
        return len(self.count) * len(self.item_bytes)

    @property
    def nbytes(self) -> int:
        per_item = self.field_len if self.fielded else self.item_bytes
        return int(self.count.sum()) * int(per_item.sum())

    def items(self) -> "RunSet":
        """The same bytes with every run cut into runs of one item (what a field copies)."""
        n = int(self.count.sum())
        first = np.repeat(np.cumsum(self.count) - self.count, self.count)
        step = np.arange(n, dtype=np.int64) - first
        return RunSet(np.repeat(self.src_start, self.count) + step, np.repeat(self.dst_start, self.count) + step,
                      np.ones(n, dtype=np.int64), self.src_region, self.dst_region, self.item_bytes,
                      self.field_off, self.field_len)

    def flatten(self) -> "Ranges":
        """Buffer-major flat ranges ([buffer 0 runs..., buffer 1 runs..., ...])."""
        rs = self.items() if self.fielded else self
        n, item = len(rs.count), rs.item_bytes[:, None]
        off = rs.field_off[:, None] if rs.fielded else np.zeros_like(item)
        unit = rs.field_len[:, None] if rs.fielded else item
        length = np.broadcast_to(rs.count[None, :] * unit, (len(rs.item_bytes), n))
        return Ranges(np.repeat(rs.src_region, n), (rs.src_start[None, :] * item + off).ravel(),
                      np.repeat(rs.dst_region, n), (rs.dst_start[None, :] * item + off).ravel(), length.ravel())

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        """Per buffer pair, the end of the furthest range on each side (bytes): bounds in O(runs)."""
        if not len(self.count):
            zero = np.zeros(len(self.item_bytes), dtype=np.int64)
            return zero, zero
        # a field ends inside the last item: at most the item's end, which is what is returned
        return ((self.src_start + self.count).max() * self.item_bytes,
                (self.dst_start + self.count).max() * self.item_bytes)


def check_ranges(side: str, region: np.ndarray, off: np.ndarray, length: np.ndarray, sizes: np.ndarray) -> None:
    """Every [off, off + length) lies inside region `region` of a table of `sizes` (vectorized)."""
    if len(length) == 0:
        return
    if len(sizes) == 0:
        raise OutOfBounds(f"{side}: no exposed regions")
    ok = (region >= 0) & (region < len(sizes)) & (off >= 0) & (length > 0)
    ok &= off + length <= sizes[np.clip(region, 0, len(sizes) - 1)]
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise OutOfBounds(f"{side}: range of {int(length[i])} bytes at region {int(region[i])} offset "
                          f"{int(off[i])} lies outside the {len(sizes)} exposed regions")


class PendingWrite(ABC):
    nbytes: int

    @abstractmethod
    def poll(self) -> bool:
        """True once every range has landed; raises a TransferError after a failure."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block (sleeping, never spinning) until landed; raises on failure or timeout."""


class PendingWrites(PendingWrite):
    """Several writes of one transfer (a streamed request's layer groups) as one: polling it
    drives every member, so ranges that landed are retired (and the peer's in-flight budget
    returned) even while the caller waits for something else."""

    POLL_S = 100e-6

    def __init__(self) -> None:
        self._writes: list[PendingWrite] = []
        self.nbytes = 0
        self.abandoned: WritesAbandoned | None = None   # a member given up on (its link closed)

    def add(self, write: PendingWrite) -> None:
        self._writes.append(write)
        self.nbytes += write.nbytes

    def poll(self) -> bool:
        """Drive every member (each retires what landed); a failed one leaves the set and its
        error is raised once all were polled."""
        remaining, failure = [], None
        for w in self._writes:
            try:
                if not w.poll():
                    remaining.append(w)
            except TransferError as exc:
                failure = failure or exc
                if isinstance(exc, WritesAbandoned):
                    self.abandoned = self.abandoned or exc
        self._writes = remaining
        if failure is not None:
            raise failure
        return not remaining

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.poll():
            if deadline is not None and time.monotonic() > deadline:
                raise WriteFailed("write", -2, "peer", self.nbytes, detail=f"not done within {timeout} s")
            time.sleep(self.POLL_S)

    def drain(self) -> None:
        """Wait until no member is in flight, whatever became of them (after a failure: the
        pages may be freed only once no write reads or writes them). Raises WritesAbandoned if
        a member was given up on: that, not the failure that led here, is what the caller must
        report (what was abandoned may still land)."""
        while self._writes:
            try:
                self.wait()
            except TransferError:
                pass
        if self.abandoned is not None:
            raise self.abandoned


class Exposure(ABC):
    """Local memory registered with a transport as numbered regions."""
    sizes: np.ndarray   # int64 [n_regions]

    @abstractmethod
    def offer(self) -> Offer: ...

    @abstractmethod
    def close(self) -> None:
        """Unregister (before the memory is freed)."""


class Link(ABC):
    """A connection from one local exposure to one peer's offered regions."""
    kind: str
    peer: str           # a printable name of the peer
    cost: LinkCost
    ordered = False     # True: writes land in the order they were submitted (one stream)
    # Writes from a CUDA pool run beside the model engine's kernels without slowing them much
    # (a copy kernel on few SMs, a NIC reading GPU memory); False: they would cost the compute
    # more than streaming hides, so `auto` does not stream over this link.
    overlaps_gpu_compute = True

    @abstractmethod
    def write_async(self, ranges: Ranges) -> PendingWrite:
        """Start writing; returns at once. Raises OutOfBounds before a byte moves if any
        range lies outside the regions on either side."""

    def write(self, ranges: Ranges, timeout: float | None = None) -> None:
        self.write_async(ranges).wait(timeout)

    def write_runs_async(self, runsets: Sequence[RunSet]) -> PendingWrite:
        """Start writing factorized ranges; by default flattened on the host."""
        return self.write_async(Ranges.concat([r.flatten() for r in runsets]))

    def write_runs(self, runsets: Sequence[RunSet], timeout: float | None = None) -> None:
        self.write_runs_async(runsets).wait(timeout)

    @abstractmethod
    def probe(self) -> None:
        """Raise PeerUnreachable unless the peer's side of the transport answers."""

    @abstractmethod
    def close(self) -> None: ...


class Transport(ABC):
    kind: str
    host: str

    @abstractmethod
    def expose(self, regions: Sequence[tuple[int, int]]) -> Exposure:
        """Register (ptr, nbytes) regions, numbered in order."""

    def reach_problem(self, offer: Offer) -> str | None:
        """None if connect(offer) can work from here, else why not (another kind; for a
        same-host transport, another host)."""
        return None if offer.kind == self.kind else f"not {self.kind}"

    def can_reach(self, offer: Offer) -> bool:
        return self.reach_problem(offer) is None

    @abstractmethod
    def connect(self, offer: Offer, local: Exposure) -> Link:
        """A link from `local` to the regions `offer` describes; raises TransferError if the
        offer is malformed or the peer cannot be reached."""

    def unsettled(self) -> int:
        """Writes given up on (their link closed) that may still land: nonzero, and no page
        they may reach is safe to reuse yet."""
        return 0

    def close(self) -> None:
        pass
