r"""GatheredWrite: one gathered send's body (transfer.gathered), on the caller's thread.

    caller's thread                                         link
      group g's layers final; its whole-item part: one direct write
      a free local slot (none: the oldest chunk's write landed first)
      gather chunk i into it (an image of the receiver's pages)
      write_async(slot -> the receiver's pages, a range per run) --->  writes i ...
      gather i + 1 into the other slot ...
    every write landed -> local slots back; the AUX row goes after (KVSender)

No receiver slot, no chunk notice, no ack: the send ends like a direct one. Two local slots
(double buffering: gather i + 1 while i's writes fly), taken only while the body is written.
"""

from collections import deque
from collections.abc import Sequence

from transfer.errors import StagingError
from transfer.gathered import GatheredChunk, GatherPlan
from transfer.transports import PreparedWrite, Ranges
from transfer.transports.base import Link, PendingWrite, PendingWrites


class GatheredWrite:
    """Writes a GatherPlan through `endpoint`'s staging slots over `link`; `run` is the send's
    _InFlight (layers, stopped, the writes it tracks)."""

    SLOTS = 2

    def __init__(self, endpoint, link: Link, run):
        self.endpoint, self.link, self.run = endpoint, link, run
        self.slots: list[int] = []  # local slots held (taken at the first chunk)
        self.free: list[int] = []  # of them, not in flight
        self.want = 0
        self.flying: deque[tuple[int, PendingWrite]] = deque()  # (local slot, its chunk's write), in order

    def send(self, plan: GatherPlan, directs: Sequence[PreparedWrite | None], layers: Sequence[int]) -> int:
        """Every group's whole-item write and gathered chunks, in group order (group g once
        layers [0, layers[g]) are final), all landed; the number of chunks. Local slots are
        taken at the first chunk (a streamed send waits for its layers holding none)."""
        self.want = min(self.SLOTS, self.endpoint.config.staging_slots, plan.num_chunks)
        try:
            for chunks, direct, needed in zip(plan.chunks, directs, layers):
                self.run.blocked(lambda n=needed: self.run.layers(n, self._retire))
                if direct is not None:
                    self.run.before_write()
                    self.run.writes.add(direct.start())
                for chunk in chunks:
                    self._write(chunk)
            self.run.blocked(self._landed)
        except BaseException:
            self._drain()  # no write reads a local slot once it is released
            raise
        finally:
            self.endpoint.staging.lease.release(self.slots)
        return plan.num_chunks

    def _take_slots(self) -> None:
        config = self.endpoint.config
        self.slots = self.endpoint.staging.lease.acquire(self.want, timeout=config.chunk_timeout_s)
        if not self.slots:
            raise StagingError("no local staging slot freed up in time")
        self.free = list(self.slots)

    def _write(self, chunk: GatheredChunk) -> None:
        """Gather `chunk` into a free local slot and start its write."""
        staging = self.endpoint.staging
        if not self.slots:
            self._take_slots()
        self._retire()
        if not self.free:  # every local slot is in flight: the oldest must land first
            self.run.blocked(self._oldest)
        slot = self.free.pop()
        chunk.gather(staging.slot(slot))
        r = chunk.ranges
        ranges = Ranges(
            r.src_region + self.endpoint.staging_region,
            r.src_off + staging.slot_offset(slot),
            r.dst_region,
            r.dst_off,
            r.length,
        )
        self.run.before_write()
        self.flying.append((slot, self.link.write_async(ranges)))

    def _retire(self) -> None:
        """Free the slots of chunks whose writes landed, in order (drives the link's retiring)."""
        while self.flying and self.flying[0][1].poll():
            self.free.append(self.flying.popleft()[0])
        self.run.writes.poll()

    def _oldest(self) -> None:
        slot, w = self.flying[0]
        w.wait()
        self.flying.popleft()
        self.free.append(slot)

    def _landed(self) -> None:
        """Every chunk's write and every whole-item write landed (the AUX row goes after)."""
        while self.flying:
            self._oldest()
        self.run.writes.wait()

    def _drain(self) -> None:
        """After a failure: wait until no chunk write of ours is in flight, whatever became of
        them; WritesAbandoned (what was given up on may still land) is what the caller hears."""
        flying = PendingWrites()
        for _, w in self.flying:
            flying.add(w)
        self.flying.clear()
        flying.drain()
