"""StagedChunks: decode's staged chunks, from ChunkLanded to ChunkDone, scattered off the loop
thread (transfer.scatters: a few workers; with N senders into one decode rank the loop used to
copy their chunks one after another).

    loop    ChunkLanded -> table.hold (a live request's own sender, else dropped) -> submit
    worker  table.live? (an abort while the chunk waited: not written) -> receiver.on_chunk
            (validates every piece first: a bad notice writes nothing)
    loop    drain -> ChunkDone (in order per sender: only after every earlier chunk of its
            is scattered; none for a request that ended meanwhile: its slots may be freed
            next) | fail the request (a bad chunk) -> table.let_go (a request forgotten
            meanwhile is freed here, never while a scatter into it runs)

The loop thread stays the one that moves requests; workers read the table (live) and copy.
"""

import logging
from collections.abc import Callable

from disagg.control.messages import ChunkDone, ChunkLanded
from disagg.decode.requests import DecodeRequest, RequestTable, Sender
from transfer.errors import StagingError
from transfer.receiver import KVReceiver
from transfer.scatters import Outcome, Scattered, ScatterPool

log = logging.getLogger(__name__)


class StagedChunks:
    """`reply(endpoint, msg)`: the loop's own send to a prefill; `wake`: makes the loop's
    receive return now (any thread)."""

    def __init__(
        self,
        requests: RequestTable,
        receiver: KVReceiver,
        reply: Callable[[str, object], None],
        wake: Callable[[], None],
        workers: int,
    ):
        self.requests, self.receiver, self.reply = requests, receiver, reply
        self.pool = ScatterPool(workers, wake, name="decode-scatter")

    def landed(self, endpoint: str, msg: ChunkLanded) -> None:
        """From the loop: a chunk of a live request from this sender goes to a worker; one for a
        request that is not ours (any more) is dropped: never scattered into freed pages."""
        r, sender = self.requests.hold(msg.transfer_id, endpoint)
        if r is None:
            return

        def copy() -> None:
            self.receiver.on_chunk(
                msg.index,
                msg.slot,
                msg.pieces,
                r.dst,
                sender.slots,
                r.kv.num_tokens,
                lanes=sender.lanes,
                prefix_len=r.prefix_len,
            )

        self.pool.submit(sender, msg.index, lambda: self.requests.live(r), copy, tag=r)

    def drain(self) -> None:
        """From the loop: the scatters that ended: ack, or fail the request; then let go of it."""
        for o in self.pool.drain():
            r: DecodeRequest = o.tag
            try:
                self._settle(o, r)
            except Exception:  # a bug must neither stop the loop nor keep the request held
                log.exception("room %d: settling chunk %d failed", r.room, o.index)
            finally:
                self.requests.let_go(r)

    def _settle(self, o: Outcome, r: DecodeRequest) -> None:
        sender: Sender = o.stream
        if o.state is Scattered.SCATTERED and o.ack_upto is not None and self.requests.live(r):
            self.reply(sender.endpoint, ChunkDone(r.room, o.ack_upto))
        elif o.state is Scattered.FAILED and isinstance(o.error, StagingError):
            self.requests.fail(r, f"bad chunk: {o.error}")  # quarantined; prefill hears Abort
        elif o.state is Scattered.FAILED:
            log.error("room %d: scattering chunk %d failed", r.room, o.index, exc_info=o.error)
            self.requests.fail(r, f"scatter of chunk {o.index} failed: {type(o.error).__name__}: {o.error}")

    def close(self) -> None:
        """Wait for the scatters running now (before the pool's memory goes)."""
        self.pool.close()
