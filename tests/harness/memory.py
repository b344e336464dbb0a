"""A fake transport for tests: exposed regions live in a table of this process, a write is a
plain host memory copy. It proves the transport seam (the sender, receiver and control plane
run over it unchanged) and injects faults at unit level; it is never used instead of a real
transport where a test is about moving bytes between processes.

The offer's blob is only a key into the table, never an address: like a transport that maps
the peer's memory elsewhere, the link resolves (region, offset) itself. Host memory only.

With `fan` (MemorySettings, --memory-fan) its links fan out (Link.fan) through one MemoryFan,
a stand-in for cuda-ipc's (transfer/transports/cuda_fan.py) that proves the interface a
fan-out's caller sees and counts the fan-outs it started; it writes each peer in turn.
"""

import ctypes
import itertools
import threading
from dataclasses import dataclass

import numpy as np

from transfer.errors import PeerUnreachable, TransportError, WriteFailed
from transfer.transports import TRANSPORTS, LinkCost, Offer, Ranges, Transport, TransportKind, TransportSettings
from transfer.transports.base import Exposure, Link, PendingWrite
from transfer.transports.ranges import check_ranges

KIND = "memory"
_exposed: dict[int, "MemoryExposure"] = {}
_ids = itertools.count(1)
_lock = threading.Lock()


class _Done(PendingWrite):
    def __init__(self, nbytes: int):
        self.nbytes = nbytes

    def poll(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        pass


class MemoryExposure(Exposure):
    def __init__(self, regions):
        self.bases = np.array([int(p) for p, _ in regions], dtype=np.int64)
        self.sizes = np.array([int(n) for _, n in regions], dtype=np.int64)
        with _lock:
            self.key = next(_ids)
            _exposed[self.key] = self

    def offer(self) -> Offer:
        return Offer(KIND, "this-process", self.key.to_bytes(8, "little"))

    def close(self) -> None:
        with _lock:
            _exposed.pop(self.key, None)


class MemoryLink(Link):
    kind = KIND
    ordered = True  # a write is done when write_async returns
    cost = LinkCost(per_range_us=1.0, link_gbps=10.0)

    def __init__(self, transport: "MemoryTransport", local: MemoryExposure, key: int):
        self._transport, self._local, self._key, self.peer = transport, local, key, f"memory:{key}"
        self.fail_writes, self.closed = transport.fail_writes, False
        transport.opened += 1

    def _peer(self) -> MemoryExposure:
        with _lock:
            peer = _exposed.get(self._key)
        if peer is None:
            raise PeerUnreachable("probe", -1, self.peer, detail="the peer closed its regions")
        return peer

    def write_async(self, ranges: Ranges) -> PendingWrite:
        if self.closed:  # (a transport that mapped the peer's memory has unmapped it)
            raise PeerUnreachable("write", -1, self.peer, ranges.nbytes, detail="the link is closed")
        peer = self._peer()
        check_ranges("source", ranges.src_region, ranges.src_off, ranges.length, self._local.sizes)
        check_ranges(f"destination {self.peer}", ranges.dst_region, ranges.dst_off, ranges.length, peer.sizes)
        if self.fail_writes:
            raise WriteFailed("write", -1, self.peer, ranges.nbytes, detail="injected by the memory transport")
        src = self._local.bases[ranges.src_region] + ranges.src_off
        dst = peer.bases[ranges.dst_region] + ranges.dst_off
        for s, d, n in zip(src.tolist(), dst.tolist(), ranges.length.tolist()):
            ctypes.memmove(d, s, n)
        return _Done(ranges.nbytes)

    def fan(self) -> "MemoryFan | None":
        return self._transport.fanout

    def probe(self) -> None:
        self._peer()

    def close(self) -> None:
        if not self.closed:  # what a transport that maps the peer's memory would unmap
            self.closed = True
            self._transport.closed += 1


class MemoryFan:
    """Writes into several peers of the memory transport as one fan-out (the Link.fan
    interface): prepare([(link, groups)]) -> start() -> a PendingWrite per peer, in order.
    `started`: the fan-outs started, their peers' counts."""

    def __init__(self) -> None:
        self.started: list[int] = []

    def prepare(self, parts) -> "_FanPrepared":
        if any(link.closed for link, _ in parts):
            raise PeerUnreachable("write", -1, "a fan-out's peer", detail="a link is closed")
        return _FanPrepared(self, [link.prepare_chain(groups) for link, groups in parts])


class _FanPrepared:
    def __init__(self, fan: MemoryFan, writes: list) -> None:
        self._fan, self._writes = fan, writes

    def start(self) -> list[PendingWrite]:
        self._fan.started.append(len(self._writes))
        return [w.start() for w in self._writes]


class MemoryTransport(Transport):
    kind = KIND
    host = "this-process"

    def __init__(self, fail_writes: bool = False, fan: bool = False):
        self.fail_writes = fail_writes
        self.opened = self.closed = 0  # links, for bookkeeping tests
        self.lanes: list[int] = []  # the lane each connect was asked for, in order
        self.fanout = MemoryFan() if fan else None  # its links' fan-out (None: each writes alone)

    def expose(self, regions) -> MemoryExposure:
        return MemoryExposure(regions)

    def connect(self, offer: Offer, local: Exposure, lane: int = 0) -> MemoryLink:
        if offer.kind != KIND or len(offer.blob) != 8 or not isinstance(local, MemoryExposure):
            raise TransportError("malformed memory offer")
        self.lanes.append(lane)
        return MemoryLink(self, local, int.from_bytes(offer.blob, "little"))


# ---- as the registry sees it, declared like any transport's (transfer/transports/kind.py) ----


@dataclass(frozen=True)
class MemorySettings:
    fail_writes: bool = False  # every write fails (a unit-level fault)
    fan: bool = False  # its links fan out (MemoryFan: a stand-in for cuda-ipc's)


def _add_flags(g) -> None:
    g.add_argument(
        "--memory-fail-writes", action="store_true", help="the memory transport fails every write (tests only)"
    )
    g.add_argument("--memory-fan", action="store_true", help="the memory transport's links fan out (tests only)")


def _create(common: TransportSettings, own: MemorySettings) -> MemoryTransport:
    return MemoryTransport(own.fail_writes, own.fan)


MEMORY = TransportKind(
    KIND,
    _create,
    MemorySettings,
    _add_flags,
    lambda args: MemorySettings(args.memory_fail_writes, args.memory_fan),
    auto=False,
)  # never part of --transport auto: it works within one process only


def register() -> None:
    """Make --transport memory available in this process (idempotent: tests call it freely)."""
    if KIND not in TRANSPORTS.names():
        TRANSPORTS.add(MEMORY)  # the one registry line
