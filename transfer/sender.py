"""KVSender: the prefill side of one transfer: plan, choose direct or staged, write, AUX last."""

import logging
import queue
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Protocol

import numpy as np

from kvpool.indices import IndexSet
from transfer.config import Mode
from transfer.cost import choose_mode
from transfer.endpoint import PoolEndpoint
from transfer.errors import AckTimeout, Cancelled, StagingError
from transfer.peer import PeerTarget
from transfer.plan import Ranges, TransferPlan, build_plan
from transfer.staging import Chunk, ChunkLanded, chunk_plan, gather

log = logging.getLogger(__name__)


class ChunkChannel(Protocol):
    """How a staged sender talks to the receiver (the control plane, or transfer.pair_channel)."""

    def notify(self, notice: ChunkLanded) -> None: ...

    def wait_done(self, transfer_id: int, index: int, timeout: float) -> None:
        """Block until the receiver reports chunk `index` (and every earlier one) scattered."""

    def end(self, transfer_id: int) -> None:
        """The transfer is over (done or failed): drop its chunk state."""


@dataclass(frozen=True)
class TransferReport:
    mode: Mode
    nbytes: int
    ranges: int        # engine ranges submitted
    chunks: int        # staged chunks (0 for direct)
    plan_ms: float
    seconds: float     # whole send, planning included


class KVSender(PoolEndpoint):
    """Registers its pool and a staging area at construction; close() (or `with`) undoes it."""

    def plan(self, peer: PeerTarget, src: IndexSet, dst: IndexSet) -> TransferPlan:
        return build_plan(src, dst, self.pool.buffer_descriptors(), list(peer.descriptors),
                          local_regions=list(self.engine.registered().items()), peer_regions=peer.regions())

    def send(self, peer: PeerTarget, src: IndexSet, dst: IndexSet, transfer_id: int = 0,
             remote_slots: list[int] | None = None, channel: ChunkChannel | None = None,
             stopped: Callable[[], bool] | None = None) -> TransferReport:
        """Move `src` (local) into `dst` (peer). Staged mode needs `remote_slots` (receiver
        staging slots leased to this transfer) and a `channel`. `stopped()` is asked before
        every write: true (the request was aborted) ends the send with Cancelled. Raises a
        TransferError or Cancelled; the receiver must treat the request as failed then."""
        t0 = time.perf_counter()
        stopped = stopped or (lambda: False)
        plan = self.plan(peer, src, dst)
        plan_ms = (time.perf_counter() - t0) * 1e3
        slot_bytes = min(self.staging.slot_bytes, peer.staging_slot_bytes or self.staging.slot_bytes)
        can_stage = bool(remote_slots) and channel is not None and peer.staging_ptr != 0
        mode = choose_mode(plan, self.config, slot_bytes, can_stage)
        ranges = chunks = 0
        if mode is Mode.DIRECT:
            body = plan.body_ranges()
            self._before_write(stopped)
            self.engine.write(peer.session_id, body.src, body.dst, body.length)
            ranges = len(body)
        else:
            chunks = self._send_staged(peer, plan, slot_bytes, transfer_id, remote_slots, channel, stopped)
            ranges = chunks
        if plan.aux is not None:  # last: its arrival means the body has landed
            aux: Ranges = plan.aux.ranges
            self._before_write(stopped)
            self.engine.write(peer.session_id, aux.src, aux.dst, aux.length)
            ranges += len(aux)
        return TransferReport(mode, plan.nbytes, ranges, chunks, plan_ms, time.perf_counter() - t0)

    def _before_write(self, stopped: Callable[[], bool]) -> None:
        if stopped():
            raise Cancelled("send stopped: the request was aborted")
        self.faults.check("send.write")

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

    def _send_staged(self, peer: PeerTarget, plan: TransferPlan, slot_bytes: int, transfer_id: int,
                     remote_slots: list[int], channel: ChunkChannel, stopped: Callable[[], bool]) -> int:
        """Gather chunk i+1 while a writer thread writes chunk i and waits for slot credits."""
        chunks = chunk_plan(plan, slot_bytes)
        local_slots = self.staging.lease.acquire(self.config.staging_slots, timeout=self.config.chunk_timeout_s)
        if not local_slots:
            raise StagingError("no local staging slot freed up in time")
        free: queue.Queue = queue.Queue()
        for s in local_slots:
            free.put(s)
        ready: queue.Queue = queue.Queue()
        errors: list[BaseException] = []
        writer = threading.Thread(target=self._write_chunks, name="kv-staged-writer",
                                  args=(peer, chunks, remote_slots, transfer_id, channel, free, ready, errors, stopped))
        writer.start()
        try:
            for chunk in chunks:
                slot = free.get()
                if slot is None:  # the writer failed
                    break
                gather(chunk, plan, self.buffers, self.staging.slot(slot))
                ready.put((slot, chunk))
        except BaseException as exc:
            errors.append(exc)
        finally:
            ready.put(None)
            writer.join()
            self.staging.lease.release(local_slots)
            channel.end(transfer_id)
        if errors:
            raise errors[0]
        return len(chunks)

    def _write_chunks(self, peer: PeerTarget, chunks: list[Chunk], remote_slots: list[int], transfer_id: int,
                      channel: ChunkChannel, free: queue.Queue, ready: queue.Queue, errors: list,
                      stopped: Callable[[], bool]) -> None:
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
                remote = remote_slots[i % n_remote]
                self._before_write(stopped)
                self.engine.write(peer.session_id, np.array([self.staging.slot_ptr(slot)], dtype=np.int64),
                                  np.array([peer.slot_ptr(remote)], dtype=np.int64),
                                  np.array([chunk.nbytes], dtype=np.int64))
                channel.notify(ChunkLanded(transfer_id, i, remote, list(chunk.pieces)))
                free.put(slot)
            if chunks:
                self._await_ack(channel, transfer_id, len(chunks) - 1, timeout, stopped)
        except BaseException as exc:
            errors.append(exc)
            free.put(None)  # wake the gatherer
