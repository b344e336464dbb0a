"""KVSender: the prefill side of one transfer: connect to a receiver over the first transport
both sides have, then per request plan, choose direct or staged, write, AUX last.

Streamed (layer-wise): while the model engine still computes, the body goes in layer groups
(transfer.layers.split_layers; sized by transfer.cost.layer_bounds), each once LayerProgress
says its layers are final; direct writes fragments of each row, staged gathers a group's
fields into chunks. The AUX row still goes last, after the engine returned and everything
landed, so decode never sees "done" before every layer."""

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.errors import SpecError
from kvpool.indices import IndexSet
from transfer.buffers import Buffer, layout_difference
from transfer.config import Mode
from transfer.cost import choose_mode, layer_bounds, streams_well
from transfer.endpoint import PoolEndpoint, StagingInfo
from transfer.errors import AckTimeout, Cancelled, LayoutIncompatible, StagingError, WritesAbandoned
from transfer.peer import RemotePool
from transfer.layers import LayerGroup, split_layers
from transfer.plan import ComponentPlan, TransferPlan, build_plan
from transfer.progress import LayerProgress
from transfer.staging import Chunk, ChunkChannel, chunk_plan, gather
from transfer.reshard import Shard, by_token, check_pair, pair_lanes
from transfer.tokens import Tokens, pool_lanes
from transfer.transports import Offer, Ranges, pick
from transfer.transports.base import PendingWrites

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferReport:
    mode: Mode
    transport: str     # the link's transport kind
    nbytes: int
    ranges: int        # transport ranges submitted
    chunks: int        # staged chunks (0 for direct)
    plan_ms: float
    seconds: float     # whole send, planning included
    submit_ms: float = 0.0   # direct: host time handing the writes to the link
    wait_ms: float = 0.0     # direct: time blocked until the link reported them landed
    groups: int = 1          # layer groups sent (streamed: more than one)
    first_write_at: float = 0.0   # wall clock (time.time) of the first body write
    streamed: bool = False   # started before the KV was complete
    cpu_ms: float = 0.0      # CPU time of the sending thread (host work beside a streamed compute)


class KVSender(PoolEndpoint):
    """Exposes its pool and a staging area at construction; close() (or `with`) undoes it."""

    @property
    def shard(self) -> Shard:
        cfg = self.pool.config
        return Shard(cfg.page_size, cfg.tp_size, cfg.tp_rank)

    def connect(self, offers: Sequence[Offer], buffers: Sequence[Buffer], staging: StagingInfo | None = None,
                page_size: int | None = None, tp: tuple[int, int] | None = None) -> RemotePool:
        """A receiver that offers `offers` (its order of preference) for `buffers` of a pool of
        `page_size` (None: ours) and TP (size, rank) `tp` (None: ours): refused with the first
        difference unless its buffers pair up with ours (another page size or TP size: those
        of our model at its page size and TP size, transfer.tokens; equal TP sizes pair rank r
        with rank r), then connected over the first transport we share. The caller closes
        `.link` when the peer goes away."""
        cfg = self.pool.config
        page_size = cfg.page_size if page_size is None else page_size
        if not isinstance(page_size, int) or page_size < 1 or page_size & (page_size - 1):
            raise LayoutIncompatible(f"the receiver's page size {page_size!r} is not a positive power of two")
        dst = Shard(page_size, *(tp or (cfg.tp_size, cfg.tp_rank)))
        check_pair(self.shard, dst)
        same_tp = dst.tp_size == cfg.tp_size
        diff = layout_difference(self.buffers, buffers, paged=same_tp and page_size == cfg.page_size,
                                 per_request=same_tp)
        if diff:
            raise LayoutIncompatible(diff)
        lanes = None
        if by_token(self.shard, dst):
            try:
                theirs = pool_lanes(cfg.model, page_size, dst.tp_size, cfg.layout, list(buffers), "destination")
            except SpecError as exc:   # their TP size does not split our model
                raise LayoutIncompatible(f"the receiver's TP size {dst.tp_size}: {exc}") from None
            lanes = pair_lanes(cfg.model, self.shard, dst, self.lanes, theirs)
        offer, transport = pick(offers, self.transports)
        return RemotePool(transport.connect(offer, self.exposures[transport.kind]), tuple(buffers), staging,
                          lanes[1] if lanes else None, lanes[0] if lanes else None, not same_tp)

    def streams_well(self, peer: RemotePool) -> bool:
        """Whether layer-wise streaming to this peer hides more than it costs the compute."""
        return streams_well(str(self.pool.config.device), peer.link)

    def plan(self, peer: RemotePool, src: IndexSet, dst: IndexSet, num_tokens: int | None = None) -> TransferPlan:
        """Plan one request; a peer of another page size needs the request's `num_tokens`."""
        tokens = None
        if peer.lanes is not None:
            if num_tokens is None:
                raise ValueError("a peer of another page size or TP size: the plan needs the request's num_tokens")
            tokens = Tokens(num_tokens, peer.src_lanes, peer.lanes, peer.sliced)
        return build_plan(src, dst, self.buffers, list(peer.buffers), tokens)

    def layer_groups(self, plan: TransferPlan, peer: RemotePool) -> list[LayerGroup]:
        """The plan cut into layer groups sized for this peer's link (transfer.cost)."""
        num_layers = self.pool.config.model.num_layers
        bounds = layer_bounds(num_layers, sum(c.nbytes for c in plan.body), peer.link.cost, self.config)
        return split_layers(plan, bounds, self.placements)

    def send(self, peer: RemotePool, src: IndexSet, dst: IndexSet, transfer_id: int = 0,
             remote_slots: list[int] | None = None, channel: ChunkChannel | None = None,
             stopped: Callable[[], bool] | None = None, progress: LayerProgress | None = None,
             num_tokens: int | None = None) -> TransferReport:
        """Move `src` (local) into `dst` (peer). Staged mode needs `remote_slots` (receiver
        staging slots leased to this transfer) and a `channel`. `stopped()` is asked before
        every write: true (the request was aborted) ends the send with Cancelled.
        With `progress` (the KV is still being computed) the body goes in layer groups, each
        as soon as its layers are final; the AUX row once progress is complete.
        Raises a TransferError or Cancelled; the receiver must treat the request as failed then.
        WritesAbandoned (whatever else went wrong): the link was closed with writes in flight,
        which may still land in the receiver's pages until the transport ends them.
        `num_tokens` (the request's length) is needed when the peer's page size is not ours."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        stopped = stopped or (lambda: False)
        plan = self.plan(peer, src, dst, num_tokens)
        streamed = progress is not None
        groups = self.layer_groups(plan, peer) if streamed else [LayerGroup(range(0), plan.body)]
        body = tuple(c for g in groups for c in g.body)    # what actually moves (fields when streamed)
        plan_ms = (time.perf_counter() - t0) * 1e3
        slot_bytes = min(self.staging.slot_bytes, peer.staging.slot_bytes if peer.staging else self.staging.slot_bytes)
        can_stage = bool(remote_slots) and channel is not None and peer.staging is not None
        mode = choose_mode(TransferPlan(body, plan.aux), peer.link.cost, self.config, slot_bytes, can_stage)
        writes = PendingWrites()   # the body's writes in flight (streamed: one per layer group)
        wait_layers = (lambda n: progress.wait(n, stopped, writes.poll)) if streamed else (lambda n: None)
        first_write: list[float] = []
        ranges = chunks = 0
        waited = 0.0
        t_submit = time.perf_counter()
        if mode is Mode.DIRECT:
            try:
                for g in groups:
                    if not g.body:
                        continue
                    t = time.perf_counter()
                    wait_layers(g.layers.stop)
                    waited += time.perf_counter() - t
                    self._before_write(stopped, first_write)
                    writes.add(peer.link.write_runs_async([c.runset for c in g.body]))
                    ranges += sum(c.num_ranges for c in g.body)
                if not peer.link.ordered:   # the AUX row may only start once the body landed
                    t = time.perf_counter()
                    writes.wait()
                    waited += time.perf_counter() - t
            except BaseException:
                writes.drain()   # a failure is reported only once no write of ours is in flight
                raise
        else:
            chunk_list = [dataclasses.replace(c, layers_needed=g.layers.stop if streamed else 0)
                          for g in groups for c in chunk_plan(g.body, slot_bytes)]
            chunks = self._send_staged(peer, plan.body, chunk_list, transfer_id, remote_slots, channel, stopped,
                                       wait_layers, first_write, share=0.5 if streamed else 1.0)
            ranges = chunks
        try:
            if progress is not None:
                progress.wait_complete(stopped, writes.poll)   # the engine returned: the AUX row is written
            if plan.aux is not None:  # last: its arrival means the body has landed
                self._before_write(stopped, first_write)
                writes.add(peer.link.write_runs_async([plan.aux.runset]))   # (an ordered link: after the body)
                ranges += len(plan.aux.runset)
            t = time.perf_counter()
            writes.wait()
            waited += time.perf_counter() - t
        except BaseException:
            writes.drain()
            raise
        submitted = (time.perf_counter() - t_submit - waited) * 1e3
        return TransferReport(mode, peer.link.kind, plan.nbytes, ranges, chunks, plan_ms, time.perf_counter() - t0,
                              submitted if mode is Mode.DIRECT else 0.0, waited * 1e3,
                              sum(1 for g in groups if g.body), first_write[0] if first_write else 0.0, streamed,
                              (time.thread_time() - cpu0) * 1e3)

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

    def _send_staged(self, peer: RemotePool, body: Sequence[ComponentPlan], chunks: list[Chunk], transfer_id: int,
                     remote_slots: list[int], channel: ChunkChannel, stopped: Callable[[], bool],
                     wait_layers: Callable[[int], None], first_write: list[float], share: float = 1.0) -> int:
        """Gather chunk i+1 while a writer thread writes chunk i and waits for slot credits.
        A streamed transfer waits for a chunk's layers before gathering it, and takes local
        slots only then, and only `share` of them (others' transfers need some meanwhile)."""
        if chunks:
            wait_layers(chunks[0].layers_needed)
        want = max(1, int(self.config.staging_slots * share))
        local_slots = self.staging.lease.acquire(want, timeout=self.config.chunk_timeout_s)
        if not local_slots:
            raise StagingError("no local staging slot freed up in time")
        free: queue.Queue = queue.Queue()
        for s in local_slots:
            free.put(s)
        ready: queue.Queue = queue.Queue()
        errors: list[BaseException] = []
        writer = threading.Thread(target=self._write_chunks, name="kv-staged-writer",
                                  args=(peer, chunks, remote_slots, transfer_id, channel, free, ready, errors, stopped,
                                        first_write))
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
            channel.end(transfer_id)
        if errors:   # an abandoned write first: it may still land, which the caller must report
            raise next((e for e in errors if isinstance(e, WritesAbandoned)), errors[0])
        return len(chunks)

    def _write_chunks(self, peer: RemotePool, chunks: list[Chunk], remote_slots: list[int], transfer_id: int,
                      channel: ChunkChannel, free: queue.Queue, ready: queue.Queue, errors: list,
                      stopped: Callable[[], bool], first_write: list[float]) -> None:
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
                self._before_write(stopped, first_write)
                peer.link.write(Ranges.one(self.staging_region, self.staging.slot_offset(slot),
                                           peer.staging.region, peer.slot_offset(remote), chunk.nbytes))
                channel.notify(transfer_id, i, remote, list(chunk.pieces))
                free.put(slot)
            if chunks:
                self._await_ack(channel, transfer_id, len(chunks) - 1, timeout, stopped)
        except BaseException as exc:
            errors.append(exc)
            free.put(None)  # wake the gatherer
