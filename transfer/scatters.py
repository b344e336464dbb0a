"""ScatterPool: a receiver's staged chunks scattered on a few worker threads, their outcomes
handed back to the one thread that owns the requests (its loop), acks in order per sender.

    loop thread     ChunkLanded -> submit(stream, index, live, copy)          (never blocks)
    worker          live()? -> copy() (validates, then copies: releases the GIL)
                    -> outcome onto a queue, wake the loop
    loop thread     drain() -> outcomes: SCATTERED (ack_upto: the ChunkDone to send now),
                    SKIPPED (the request ended while the chunk waited), FAILED (the error)

With N senders into one receiver, scattering on the loop thread ran their chunks one after
another (issue 40: the N -> 1 rows' bottleneck); here chunks of different senders, and the
chunks one sender has in flight, are copied side by side. A sender's acks are cumulative
(transfer.leases.AckLedger: an ack of chunk i says every earlier one is scattered and its
slot free), so an outcome is acknowledged only once every earlier chunk of its stream that
was submitted is scattered too; a chunk that failed or was skipped ends its stream's acks
from that chunk on (those below it are still acknowledged as they finish: the sender's
AckTimeout then says how far its chunks got; decode acks only a live request anyway).

The pool knows nothing of requests: `live` and `copy` are the owner's (decode: the request
table's recheck, the receiver's scatter). The owner keeps a request's pages and slots held
from submit to the drained outcome; workers only copy and report.
"""

import queue
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum


class Scattered(Enum):
    SCATTERED = "copied into the request's pages"
    SKIPPED = "not copied: the request ended while the chunk waited"
    FAILED = "not copied (a bad notice: nothing written) or the copy raised"


@dataclass(frozen=True)
class Outcome:
    stream: Hashable  # the owner's key of one sender of one request
    index: int  # the chunk
    state: Scattered
    tag: object = None  # the owner's, passed through (decode: the request)
    error: Exception | None = None  # FAILED: why
    ack_upto: int | None = None  # SCATTERED: the highest chunk of the stream to acknowledge now


@dataclass
class _Stream:
    """One stream's chunks between submit and ack (the loop's own, never a worker's)."""

    waiting: list[int] = field(default_factory=list)  # submitted, not drained (a multiset)
    held: list[int] = field(default_factory=list)  # scattered, an earlier chunk still waiting
    stop: float = float("inf")  # the lowest chunk that failed or was skipped: none from it on is acked

    def settle(self, index: int, state: Scattered) -> int | None:
        """Chunk `index` came back in `state`: the chunk to acknowledge now, if any. Chunks
        below a failed one are still acknowledged as they finish (an ack of i says only that
        every chunk up to i is scattered), so the sender can tell how far its chunks got."""
        self.waiting.remove(index)
        if state is Scattered.SCATTERED:
            self.held.append(index)
        else:
            self.stop = min(self.stop, index)
        low = min(self.waiting, default=self.stop)
        ready = [i for i in self.held if i < min(low, self.stop)]
        self.held = [i for i in self.held if i not in ready and i < self.stop]
        return max(ready) if ready else None


class ScatterPool:
    """`workers` threads; `wake` (any thread) makes the owner's loop drain soon (its
    control socket's wake: no poll timeout between a scatter's end and its ack)."""

    def __init__(self, workers: int, wake: Callable[[], None], name: str = "scatter"):
        if workers < 1:
            raise ValueError(f"scatter workers must be >= 1, got {workers}")
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=name)
        self._done: queue.SimpleQueue[Outcome] = queue.SimpleQueue()
        self._wake = wake
        self._streams: dict[Hashable, _Stream] = {}

    def submit(
        self, stream: Hashable, index: int, live: Callable[[], bool], copy: Callable[[], None], tag: object = None
    ) -> None:
        """From the owner's loop: scatter chunk `index` of `stream` on a worker (`copy`, once
        `live()` says its request is still the chunk's to write); drain() returns the outcome."""
        self._streams.setdefault(stream, _Stream()).waiting.append(index)
        self._pool.submit(self._run, stream, index, live, copy, tag)

    def _run(self, stream: Hashable, index: int, live, copy, tag) -> None:
        try:
            if not live():
                outcome = Outcome(stream, index, Scattered.SKIPPED, tag)
            else:
                copy()
                outcome = Outcome(stream, index, Scattered.SCATTERED, tag)
        except Exception as exc:  # reported to the loop, which fails the request
            outcome = Outcome(stream, index, Scattered.FAILED, tag, exc)
        self._done.put(outcome)
        self._wake()

    def drain(self) -> list[Outcome]:
        """From the owner's loop: every outcome that came back since the last call, each with
        the ack it releases (ack_upto), in the order they came back."""
        out = []
        while True:
            try:
                o = self._done.get_nowait()
            except queue.Empty:
                return out
            s = self._streams[o.stream]
            ack = s.settle(o.index, o.state)
            if not s.waiting:
                del self._streams[o.stream]
            out.append(Outcome(o.stream, o.index, o.state, o.tag, o.error, ack))

    def busy(self) -> int:
        """Chunks submitted and not drained yet (from the owner's loop)."""
        return sum(len(s.waiting) for s in self._streams.values())

    def close(self) -> None:
        """Wait for the running scatters (their pages must outlive them); queued ones are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)
