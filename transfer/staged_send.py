"""The staged half of KVSender.send (and the check before every write): gather chunk i+1
into a local staging slot while a writer thread writes chunk i into a remote slot leased to
the transfer, tells the receiver over the chunk channel, and waits for its ack before it
reuses that remote slot.

    gatherer (caller's thread)         writer thread                      receiver
      wait for the chunk's layers
      free local slot -> gather  --->  remote slot i % n (ack of i-n first)
                                       link.write(slot -> slot) ----->    scatter, ack i
                                       channel.notify(i)
"""

import queue
import threading
import time
from collections.abc import Callable, Sequence

from transfer.endpoint import PoolEndpoint
from transfer.errors import AckTimeout, Cancelled, StagingError, WritesAbandoned
from transfer.peer import RemotePool
from transfer.plan import ComponentPlan
from transfer.staging import Chunk, ChunkChannel, RemoteSlots, gather
from transfer.transports import Ranges



class StagedSender(PoolEndpoint):
    def _before_write(self, stopped: Callable[[], bool], first_write: list[float] | None = None) -> None:
        if stopped():
            raise Cancelled("send stopped: the request was aborted")
        self.faults.check("send.write")
        if first_write is not None and not first_write:
            first_write.append(time.time())

    @staticmethod
    def _await_ack(channel: ChunkChannel, transfer_id: int, index: int, timeout: float,
                   stopped: Callable[[], bool]) -> None:
        """channel.wait_done in short slices: an aborted request (whose receiver stopped
        acking) ends the wait now, not after the whole chunk timeout."""
        give_up = time.monotonic() + timeout
        while True:
            try:
                return channel.wait_done(transfer_id, index, min(0.2, max(0.0, give_up - time.monotonic())))
            except AckTimeout:
                if stopped():
                    raise Cancelled("send stopped while waiting for an ack: the request was aborted") from None
                if time.monotonic() >= give_up:
                    raise AckTimeout(f"transfer {transfer_id}: no ack for chunk {index} within {timeout} s") from None

    def _send_staged(self, peer: RemotePool, body: Sequence[ComponentPlan], chunks: list[Chunk],
                     remote: RemoteSlots, stopped: Callable[[], bool], wait_layers: Callable[[int], None],
                     first_write: list[float], share: float = 1.0) -> int:
        """Gather chunk i+1 while a writer thread writes chunk i and waits for slot credits.
        A streamed transfer waits for a chunk's layers before gathering it, and takes local
        slots only then, and only `share` of them (others' transfers need some meanwhile)."""
        if chunks:
            wait_layers(chunks[0].layers_needed)
        # no more local slots than it can use: one per chunk, and at most one gathering beyond the
        # remote slots in flight; the rest stay free for this sender's other destinations (TP 1 -> 8:
        # eight sends at once, which with all slots each ran one after the other)
        want = max(1, min(int(self.config.staging_slots * share), len(chunks), len(remote.slots) + 1))
        local_slots = self.staging.lease.acquire(want, timeout=self.config.chunk_timeout_s)
        if not local_slots:
            raise StagingError("no local staging slot freed up in time")
        free: queue.Queue = queue.Queue()
        for s in local_slots:
            free.put(s)
        ready: queue.Queue = queue.Queue()
        errors: list[BaseException] = []
        writer = threading.Thread(target=self._write_chunks, name="kv-staged-writer",
                                  args=(peer, chunks, remote, free, ready, errors, stopped, first_write))
        writer.start()
        try:
            for chunk in chunks:
                wait_layers(chunk.layers_needed)
                slot = free.get()
                if slot is None:  # the writer failed
                    break
                gather(chunk, body, self.tensors, self.staging.slot(slot))
                ready.put((slot, chunk))
        except BaseException as exc:
            errors.append(exc)
        finally:
            ready.put(None)
            writer.join()
            self.staging.lease.release(local_slots)
            remote.channel.end(remote.transfer_id)
        if errors:   # an abandoned write first: it may still land, which the caller must report
            raise next((e for e in errors if isinstance(e, WritesAbandoned)), errors[0])
        return len(chunks)

    def _write_chunks(self, peer: RemotePool, chunks: list[Chunk], remote: RemoteSlots, free: queue.Queue,
                      ready: queue.Queue, errors: list, stopped: Callable[[], bool], first_write: list[float]) -> None:
        remote_slots, transfer_id, channel = remote.slots, remote.transfer_id, remote.channel
        n_remote = len(remote_slots)
        timeout = self.config.chunk_timeout_s
        try:
            for i in range(len(chunks)):
                item = ready.get()
                if item is None:
                    return
                slot, chunk = item
                if i >= n_remote:  # the remote slot is reused: wait until its last chunk was scattered
                    self._await_ack(channel, transfer_id, i - n_remote, timeout, stopped)
                into = remote_slots[i % n_remote]
                self._before_write(stopped, first_write)
                peer.link.write(Ranges.one(self.staging_region, self.staging.slot_offset(slot),
                                           peer.staging.region, peer.slot_offset(into), chunk.nbytes))
                channel.notify(transfer_id, i, into, list(chunk.pieces))
                free.put(slot)
            if chunks:
                self._await_ack(channel, transfer_id, len(chunks) - 1, timeout, stopped)
        except BaseException as exc:
            errors.append(exc)
            free.put(None)  # wake the gatherer
