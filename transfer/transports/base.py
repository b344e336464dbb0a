"""The transport interface: how bytes get from this process's memory into a peer's.

    Transport                       one per process and kind (Mooncake, later CUDA IPC, ...)
      expose(regions) -> Exposure   register local memory as numbered regions
        Exposure.offer() -> Offer   what a peer needs to reach them: kind, host, opaque blob
      connect(offer, exposure) -> Link
        Link.write_async(ranges)    (local region, offset) -> (peer region, offset), length
          -> PendingWrite           pollable; wait() sleeps (a GPU link watches a
                                    write's expected tail: pace.py)
        Link.write_runs(runsets)    the same, factorized (runs x buffer pairs); a transport
                                    that can expand on its own device overrides it
        Link.prepare_runs(runsets)  checked and laid out now (while the KV is still being
          -> PreparedWrite          computed), started later: start() -> PendingWrite is
                                    only the hand-off to the link
        Link.chain(prepared)        an ordered link's writes as one hand-off, in order
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

from transfer.errors import TransferError, WriteFailed, WritesAbandoned
from transfer.transports.ranges import LaneRuns, Ranges, RunSet


class Offer(msgspec.Struct, frozen=True, array_like=True):
    """One way to reach a side's exposed regions (it travels in the registration)."""

    kind: str  # transport name in the registry
    host: str  # host identity: same-host transports only connect where this matches
    blob: bytes  # the transport's own reachability data (opaque to everyone else)


@dataclass(frozen=True)
class LinkCost:
    per_range_us: float  # cost of each separate byte range
    link_gbps: float  # one large write


class PendingWrite(ABC):
    nbytes: int

    @abstractmethod
    def poll(self) -> bool:
        """True once every range has landed; raises a TransferError after a failure."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> None:
        """Block until landed, sleeping (a GPU link watches the tail of a write's expected
        time, transports/pace.py); raises on failure or timeout."""


class PreparedWrite(ABC):
    """A write checked and laid out ahead of its bytes (Link.prepare_runs); it starts once."""

    nbytes: int

    @abstractmethod
    def start(self) -> PendingWrite:
        """Hand it to the link now; raises PeerUnreachable if the link closed meanwhile."""


class _Later(PreparedWrite):
    """The default: ranges flattened now, checked and written by write_async at start()."""

    def __init__(self, link: "Link", ranges: Ranges):
        self._link, self._ranges, self.nbytes = link, ranges, ranges.nbytes

    def start(self) -> PendingWrite:
        if self._ranges is None:
            raise RuntimeError("a prepared write starts once")
        ranges, self._ranges = self._ranges, None
        return self._link.write_async(ranges)


class _Chain(PreparedWrite):
    """The default Link.chain: each write started in order, waited on as one."""

    def __init__(self, writes: Sequence[PreparedWrite]):
        self._writes, self.nbytes = list(writes), sum(w.nbytes for w in writes)

    def start(self) -> PendingWrite:
        started = PendingWrites(ordered=True)
        try:
            for w in self._writes:
                started.add(w.start())
        except BaseException:
            started.drain()  # what started is done before the failure is reported
            raise
        return started


class PendingWrites(PendingWrite):
    """Several writes of one transfer (a streamed request's layer groups) as one: polling it
    drives every member, so ranges that landed are retired (and the peer's in-flight budget
    returned) even while the caller waits for something else."""

    POLL_S = 100e-6

    def __init__(self, ordered: bool = False) -> None:
        self.ordered = ordered  # the link lands writes in order: the last one landed means all did
        self._writes: list[PendingWrite] = []
        self.nbytes = 0
        self.abandoned: WritesAbandoned | None = None  # a member given up on (its link closed)

    def add(self, write: PendingWrite) -> None:
        """A write of the transfer; a set of them (a chain's) joins member by member, so that
        a member's failure, raised once by the set that polls it, is not lost in a nested one."""
        if isinstance(write, PendingWrites):
            for w in write._writes:
                self.add(w)
            self.abandoned = self.abandoned or write.abandoned
            return
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
        """Sleep until every member landed: on an ordered link in each member's own wait, in
        order (each ends about when the next starts: a paced CUDA write learns its own time),
        else polling all."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.ordered:
            try:
                for w in self._writes:
                    w.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
            except TransferError:
                pass  # raised below by poll(), with the other members retired first
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

    sizes: np.ndarray  # int64 [n_regions]

    @abstractmethod
    def offer(self) -> Offer: ...

    @abstractmethod
    def close(self) -> None:
        """Unregister (before the memory is freed)."""


class Link(ABC):
    """A connection from one local exposure to one peer's offered regions."""

    kind: str
    peer: str  # a printable name of the peer
    cost: LinkCost
    ordered = False  # True: writes land in the order they were submitted (one stream)
    # True: a write has landed when write_async returns, copied by the calling thread (into a
    # process of this host): it never waits on a network or a peer's answer
    synchronous = False
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

    def write_runs_async(self, runsets: Sequence[RunSet | LaneRuns]) -> PendingWrite:
        """Start writing factorized ranges."""
        return self.prepare_runs(runsets).start()

    def prepare_runs(self, runsets: Sequence[RunSet | LaneRuns]) -> PreparedWrite:
        """Lay factorized ranges out for a later start(): what can be done before the bytes
        are final is done here (a transport that can, checks bounds here too: OutOfBounds).
        By default flattened on the host and written (checked) by write_async at start()."""
        return _Later(self, Ranges.concat([r.flatten() for r in runsets]))

    def prepare_chain(self, groups: Sequence[Sequence[RunSet | LaneRuns]]) -> PreparedWrite:
        """Groups of runsets prepared as one write that lands them in order (an ordered link
        only: a body, then its AUX row). By default each group prepared and chained; a
        transport may lay them out together (cuda-ipc: one table, one upload)."""
        return self.chain([self.prepare_runs(g) for g in groups])

    def chain(self, writes: Sequence[PreparedWrite]) -> PreparedWrite:
        """Prepared writes of this link as one hand-off that lands them in order (an ordered
        link only: a later one lands after an earlier one). A transport may start them in
        one go (cuda-ipc: one launch sequence, one event)."""
        if not self.ordered:
            raise ValueError(f"{self.kind} does not land writes in order: they cannot be chained")
        return _Chain(writes)

    def write_runs(self, runsets: Sequence[RunSet | LaneRuns], timeout: float | None = None) -> None:
        self.write_runs_async(runsets).wait(timeout)

    def fan(self):
        """What writes to several peers of this transport at once as one (a fan-out:
        prepare([(link, groups)]) -> start() -> a PendingWrite per link), or None: each
        link writes on its own (cuda-ipc has one: transports/cuda_fan.py)."""
        return None

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
    def connect(self, offer: Offer, local: Exposure, lane: int = 0) -> Link:
        """A link from `local` to the regions `offer` describes; raises TransferError if the
        offer is malformed or the peer cannot be reached. `lane`: which of its threads (and
        the peer's) a transport with several carries this link on (Mooncake TCP's engines);
        the others have one and ignore it."""

    def unsettled(self) -> int:
        """Bytes given up on that may still land: writes of ours whose link closed or that
        failed, or a peer's into our regions (Mooncake TCP: sockets closed with bytes on their
        way); nonzero, and no page they may reach is safe to reuse yet."""
        return 0

    def close(self) -> None:  # noqa: B027 (optional: a transport holding nothing has nothing to close)
        """Release what the transport holds (its engine, registrations)."""
