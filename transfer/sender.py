"""KVSender: the prefill side of one transfer: connect to a receiver over the first transport
both sides have, then per request plan, choose direct or staged, write, AUX last.

Prepared ahead: prepare() does everything that needs only the two sides' indices (plan, layer
groups, the mode, and each direct write checked and laid out by its link: on cuda-ipc its
table is on the GPU already), so it can run while the engine still computes; send(prepared=)
then only starts writes once the KV is final.

Streamed (layer-wise): while the model engine still computes, the body goes in layer groups
(transfer.layers.split_layers; sized by transfer.cost.layer_bounds), each once LayerProgress
says its layers are final; direct writes fragments of each row, staged gathers a group's
fields into chunks. The AUX row still goes last, after the engine returned and everything
landed, so decode never sees "done" before every layer.

Staged (StagedWrite), all on the caller's thread: gather chunk i+1 into a local staging slot
while the link writes chunk i into a remote slot leased to the transfer; a chunk that landed is
told to the receiver over the chunk channel, and its remote slot is reused only after its ack.

    caller's thread                                      link              receiver
      wait for chunk i's layers; a free local slot
      gather i; (i >= n: ack of i-n first)
      write_async(local slot -> remote slot i % n) --->  writes i ...
      gather i+1 ...; writes that landed: notify(j) ------------------->  scatter j, ack j

A KVSender has an endpoint (transfer.endpoint.PoolEndpoint: the pool and staging area exposed
to the transports); whoever built the endpoint closes it, after the sender's last send."""

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvpool.errors import SpecError
from kvpool.indices import IndexSet
from transfer.buffers import Buffer, layout_difference
from transfer.config import Mode
from transfer.cost import choose_mode, layer_bounds, streams_well
from kvpool.geometry import Component
from transfer.endpoint import PoolEndpoint, StagingInfo
from transfer.errors import AckTimeout, Cancelled, LayoutIncompatible, StagingError
from transfer.faults import FaultInjector
from transfer.layers import LayerGroup, split_layers
from transfer.plan import ComponentPlan, TransferPlan, build_plan
from transfer.progress import LayerProgress
from transfer.gather import Gatherer
from transfer.gathered import GatherPlan, gather_plan, gatherable
from transfer.gathered_write import GatheredWrite
from transfer.staging import Chunk, RemoteSlots, chunk_plan
from transfer.report import TransferReport
from transfer.reshard import Shard, by_token, check_pair, pair_lanes, peer_shard, unpaired
from transfer.suffix import suffix_of
from transfer.tokens import Lane, Tokens
from transfer.transports import Offer, PreparedWrite, Ranges, pick
from transfer.transports.base import Link, PendingWrite, PendingWrites

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemotePool:
    """What a sender knows of one receiver: a connected link, its buffers, its staging area."""

    link: Link  # the transport picked for this peer, connected
    buffers: tuple[Buffer, ...]  # the receiver's pool buffers (regions 0..n-1)
    staging: StagingInfo | None = None  # the receiver's staging area (None: direct only)
    # by lane (transfer.reshard), when its page size or TP size is not ours: its lanes, ours
    # paired with them (lane i with lane i), and whether they are TP slices
    lanes: Mapping[Component, tuple[Lane, ...]] | None = None
    src_lanes: Mapping[Component, tuple[Lane, ...]] | None = None
    sliced: bool = False
    page_size: int | None = None  # its pool's page size (None: the sender's)

    def slot_offset(self, slot: int) -> int:
        return slot * self.staging.slot_bytes


@dataclass(eq=False)
class PreparedSend:
    """One request's send laid out before its KV is final (KVSender.prepare); one send uses it
    (its writes start once)."""

    peer: RemotePool
    src: IndexSet
    dst: IndexSet
    plan: TransferPlan
    groups: tuple[LayerGroup, ...]  # one (the whole body) unless streamed
    mode: Mode
    writes: tuple[PreparedWrite | None, ...]  # direct: one per group (None: nothing in it); staged: ()
    aux: PreparedWrite | None  # None: none, or chained behind the body (an ordered link, not streamed)
    ranges: int  # transport ranges of the direct writes
    plan_ms: float
    prepare_ms: float
    streamed: bool
    can_stage: bool
    num_tokens: int | None
    used: bool = False
    prefix_len: int = 0  # the receiver's own prefix, left out (transfer.suffix)
    gather: GatherPlan | None = None  # gathered: the by-token components' chunks (writes: the rest's)

    def fits(
        self,
        peer: RemotePool,
        src: IndexSet,
        dst: IndexSet,
        streamed: bool,
        can_stage: bool,
        num_tokens: int | None,
        *,
        prefix_len: int = 0,
    ) -> bool:
        """Whether it is this send's: same peer link, indices, length, prefix, streaming and staging."""
        return (
            not self.used
            and self.peer is peer
            and self.streamed == streamed
            and self.can_stage == can_stage
            and self.num_tokens == num_tokens
            and self.prefix_len == prefix_len
            and same_indices(self.src, src)
            and same_indices(self.dst, dst)
        )


def same_indices(a: IndexSet, b: IndexSet) -> bool:
    """Whether two index sets name the same indices of the same components."""
    return a is b or (a.components() == b.components() and all(np.array_equal(a[c], b[c]) for c in a.components()))


class KVSender:
    """Sends from `endpoint`'s pool (its buffers, staging area and transports), which the
    caller built and closes after the last send."""

    def __init__(self, endpoint: PoolEndpoint):
        self.endpoint = endpoint
        self._buffers = tuple(endpoint.buffers)  # a tuple: grouped and paired once (transfer.buffer_sets)
        self._gather_layouts: dict = {}  # gathered sends' lane pairings, worked out once (transfer.gathered)

    @property
    def shard(self) -> Shard:
        return self.endpoint.pool.config.shard

    def connect(
        self,
        offers: Sequence[Offer],
        buffers: Sequence[Buffer],
        staging: StagingInfo | None = None,
        page_size: int | None = None,
        tp: tuple[int, int] | None = None,
    ) -> RemotePool:
        """A receiver that offers `offers` (its order of preference) for `buffers` of a pool of
        `page_size` (None: ours) and TP (size, rank) `tp` (None: ours): refused with the first
        difference unless its buffers pair up with ours (another page size or TP size: those
        of our model at its page size and TP size, transfer.tokens; equal TP sizes pair rank r
        with rank r), then connected over the first transport we share. The caller closes
        `.link` when the peer goes away."""
        cfg = self.endpoint.pool.config
        page_size = cfg.page_size if page_size is None else page_size
        dst = peer_shard(page_size, *(tp or (cfg.tp_size, cfg.tp_rank)), whose="the receiver's", own=self.shard)
        check_pair(self.shard, dst)
        same_tp = dst.tp_size == cfg.tp_size
        diff = layout_difference(
            self.endpoint.buffers, buffers, paged=same_tp and page_size == cfg.page_size, per_request=same_tp
        )
        if diff:
            raise LayoutIncompatible(diff)
        lanes = None
        if by_token(self.shard, dst):
            if self.endpoint.no_rows or (same_tp and self.endpoint.whole_states):
                raise unpaired(self.shard, dst, self.endpoint.no_rows or self.endpoint.whole_states)
            try:
                theirs = self.endpoint.lanes_of(page_size, dst.tp_size, list(buffers), "destination")
            except SpecError as exc:  # their TP size does not split our model
                raise LayoutIncompatible(f"the receiver's TP size {dst.tp_size}: {exc}") from None
            lanes = pair_lanes(cfg.model, self.shard, dst, self.endpoint.lanes, theirs)
        offer, transport = pick(offers, self.endpoint.transports)
        lane = cfg.tp_rank + dst.tp_rank  # a receiver's N senders, a sender's M receivers: N, M lanes
        return RemotePool(
            transport.connect(offer, self.endpoint.exposures[transport.kind], lane),
            tuple(buffers),
            staging,
            lanes[1] if lanes else None,
            lanes[0] if lanes else None,
            not same_tp,
            page_size,
        )

    def streams_well(self, peer: RemotePool) -> bool:
        """Whether layer-wise streaming to this peer hides more than it costs the compute."""
        return streams_well(str(self.endpoint.pool.config.device), peer.link)

    def plan(
        self, peer: RemotePool, src: IndexSet, dst: IndexSet, num_tokens: int | None = None, prefix_len: int = 0
    ) -> TransferPlan:
        """Plan one request; a peer of another page size needs the request's `num_tokens`, and
        so does a receiver that holds the first `prefix_len` positions (transfer.suffix)."""
        suffix = suffix_of(num_tokens, prefix_len, peer.page_size or self.endpoint.pool.config.page_size)
        tokens = None
        if peer.lanes is not None:
            if num_tokens is None:
                raise ValueError("a peer of another page size or TP size: the plan needs the request's num_tokens")
            tokens = Tokens(num_tokens, peer.src_lanes, peer.lanes, peer.sliced)
        return build_plan(src, dst, self._buffers, peer.buffers, tokens, suffix)

    def layer_groups(self, plan: TransferPlan, peer: RemotePool) -> list[LayerGroup]:
        """The plan cut into layer groups sized for this peer's link (transfer.cost)."""
        num_layers = self.endpoint.pool.config.model.num_layers
        bounds = layer_bounds(num_layers, sum(c.nbytes for c in plan.body), peer.link.cost, self.endpoint.config)
        return split_layers(plan, bounds, self.endpoint.placements)

    def prepare(
        self,
        peer: RemotePool,
        src: IndexSet,
        dst: IndexSet,
        num_tokens: int | None = None,
        streamed: bool = False,
        can_stage: bool = False,
        *,
        prefix_len: int = 0,
    ) -> PreparedSend:
        """Everything of a send that needs only the indices: plan, layer groups (`streamed`),
        direct or staged (`can_stage`: the receiver leased staging slots and a chunk channel
        exists), each direct write and the AUX row's prepared by the link. Moves no byte, so
        it may run while the engine computes the KV. Raises what planning raises."""
        t0 = time.perf_counter()
        plan = self.plan(peer, src, dst, num_tokens, prefix_len)
        groups = tuple(self.layer_groups(plan, peer) if streamed else [LayerGroup(range(0), plan.body)])
        body = tuple(c for g in groups for c in g.body)  # what actually moves (fields when streamed)
        plan_ms = (time.perf_counter() - t0) * 1e3
        gather = self._gather_plan(groups, streamed)
        whole = [c for c in body if not c.by_token] if gather is not None else []
        mode = choose_mode(
            TransferPlan(body, plan.aux),
            peer.link.cost,
            self.endpoint.config,
            self._chunk_bytes(peer, body),
            can_stage,
            gather.num_ranges + sum(c.num_ranges for c in whole) if gather is not None else None,
        )
        writes, aux = self._prepare_writes(peer, plan, groups, mode, streamed)
        ranges = sum(c.num_ranges for c in body) + (len(plan.aux.runset) if plan.aux is not None else 0)
        if mode is Mode.GATHERED:
            ranges += gather.num_ranges - sum(c.num_ranges for c in body if c.by_token)
        return PreparedSend(
            peer,
            src,
            dst,
            plan,
            groups,
            mode,
            writes,
            aux,
            ranges,
            plan_ms,
            (time.perf_counter() - t0) * 1e3,
            streamed,
            can_stage,
            num_tokens,
            prefix_len=prefix_len,
            gather=gather if mode is Mode.GATHERED else None,
        )

    def _gathers(self) -> bool:
        """Whether sends may go gathered at all: AUTO or GATHERED configured, the staging area
        (and so the pool) in host memory."""
        cfg = self.endpoint.config
        return cfg.mode in (Mode.AUTO, Mode.GATHERED) and self.endpoint.staging.buffer.device.type == "cpu"

    def _gather_plan(self, groups: Sequence[LayerGroup], streamed: bool) -> GatherPlan | None:
        """The send's gathered chunks (transfer.gathered) where it may go gathered (_gathers);
        None otherwise."""
        if not self._gathers():
            return None
        return gather_plan(
            groups, self.endpoint.staging.slot_bytes, self.endpoint.tensors, streamed, self._gather_layouts
        )

    def may_stage(self, peer: RemotePool) -> bool:
        """Whether a send to `peer` may ever want its staging slots; False lets it lend us none.

        False where our mode never stages (DIRECT), or where every send to it is weighed
        gathered against direct only (choose_mode): AUTO or GATHERED, host pools, and every
        by-token component's lane pairing gatherable (transfer.gathered.gatherable; its layouts
        cached for the sends). True otherwise (STAGED; whole pages, which stage where cheaper).
        A send to a peer that lent no slot still goes right if its own gather_plan fails
        (rows not in whole units): can_stage is False without slots, and choose_mode then
        picks DIRECT, never STAGED, so the promise only costs that rare send a direct write."""
        mode = self.endpoint.config.mode
        if mode is Mode.DIRECT:
            return False
        if mode is Mode.STAGED or peer.lanes is None or not self._gathers():
            return True
        pairings = [
            (ours, peer.lanes[c], self.endpoint.tensors[c])
            for c, ours in peer.src_lanes.items()
            if not c.sent_last  # the AUX row goes after the body, always direct
        ]
        return not pairings or not gatherable(pairings, self.endpoint.staging.slot_bytes, self._gather_layouts)

    @staticmethod
    def _prepare_writes(
        peer: RemotePool, plan: TransferPlan, groups: Sequence[LayerGroup], mode: Mode, streamed: bool
    ) -> tuple[tuple[PreparedWrite | None, ...], PreparedWrite | None]:
        """The direct writes (gathered: of the whole-item components) per layer group, and the
        AUX row's (None: chained behind the body, on an ordered link when not streamed)."""
        aux_runs = [plan.aux.runset] if plan.aux is not None else None
        if (
            mode is Mode.DIRECT
            and peer.link.ordered
            and not streamed
            and aux_runs
            and len(groups) == 1
            and groups[0].body
        ):
            # the AUX row behind the body, one hand-off (cuda-ipc: one table, one upload)
            return (peer.link.prepare_chain([[c.runset for c in groups[0].body], aux_runs]),), None
        writes: tuple[PreparedWrite | None, ...] = ()
        if mode in (Mode.DIRECT, Mode.GATHERED):
            keep = (lambda c: True) if mode is Mode.DIRECT else (lambda c: not c.by_token)
            runs = [[c.runset for c in g.body if keep(c)] for g in groups]
            writes = tuple(peer.link.prepare_runs(r) if r else None for r in runs)
        return writes, peer.link.prepare_runs(aux_runs) if aux_runs else None

    @staticmethod
    def can_stage(peer: RemotePool, remote: RemoteSlots | None) -> bool:
        """Whether a send may go staged: the receiver leased it staging slots and a chunk
        channel exists (prepare()'s `can_stage`, as send() decides it)."""
        return remote is not None and bool(remote.slots) and remote.channel is not None and peer.staging is not None

    def _slot_bytes(self, peer: RemotePool) -> int:
        own = self.endpoint.staging.slot_bytes
        return min(own, peer.staging.slot_bytes if peer.staging else own)

    def _chunk_bytes(self, peer: RemotePool, body: Sequence[ComponentPlan]) -> int:
        """A staged chunk's bound: the configured chunk size (0: a whole slot), never below the
        largest item that moves (an item is never split) nor above either side's slot."""
        slot, want = self._slot_bytes(peer), self.endpoint.config.staging_chunk_bytes
        if not want:
            return slot
        return min(slot, max([want, *(u for cp in body for u in cp.unit_bytes)]))

    def send(
        self,
        peer: RemotePool,
        src: IndexSet,
        dst: IndexSet,
        remote: RemoteSlots | None = None,
        *,
        num_tokens: int | None = None,
        stopped: Callable[[], bool] | None = None,
        progress: LayerProgress | None = None,
        prepared: PreparedSend | None = None,
        prefix_len: int = 0,
    ) -> TransferReport:
        """Move `src` (local) into `dst` (peer). Staged mode needs `remote` (the receiver's
        staging slots leased to this transfer, and a chunk channel). `stopped()` is asked before
        planning and before every write (a body chained with its AUX row is one): true (the
        request was aborted) ends the send with Cancelled.
        With `progress` (the KV is still being computed) the body goes in layer groups, each
        as soon as its layers are final; the AUX row once progress is complete.
        `prepared`: this send prepared ahead (prepare() with the same peer, indices, length,
        streaming and staging, not used before); anything else is planned here.
        Raises a TransferError or Cancelled; the receiver must treat the request as failed then.
        WritesAbandoned (whatever else went wrong): the link was closed with writes in flight,
        which may still land in the receiver's pages until the transport ends them.
        `num_tokens` (the request's length) is needed when the peer's page size is not ours.
        `prefix_len`: the receiver holds positions [0, prefix_len) already; only the rest of the
        paged components moves (transfer.suffix; a bad one is BadPrefix, before any write)."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        run = _InFlight(PendingWrites(peer.link.ordered), stopped or (lambda: False), progress, self.endpoint.faults)
        if run.stopped():  # aborted while queued: not even planned
            raise Cancelled("send stopped: the request was aborted")
        can_stage, streamed = self.can_stage(peer, remote), progress is not None
        ahead = prepared is not None and prepared.fits(
            peer, src, dst, streamed, can_stage, num_tokens, prefix_len=prefix_len
        )
        p = prepared if ahead else self.prepare(peer, src, dst, num_tokens, streamed, can_stage, prefix_len=prefix_len)
        p.used = True
        t_submit, chunks = time.perf_counter(), 0
        try:
            if p.mode is Mode.DIRECT:
                self._write_direct(peer, p, run)
            elif p.mode is Mode.GATHERED:
                layers = [g.layers.stop if streamed else 0 for g in p.groups]
                chunks = GatheredWrite(self.endpoint, peer.link, run).send(p.gather, p.writes, layers)
            else:
                chunks = self._write_staged(peer, p, remote, run)
            self._write_aux(p, run)
        except BaseException:
            run.writes.drain()  # a failure is reported only once no write of ours is in flight
            raise
        direct = p.mode is Mode.DIRECT
        staged_ranges = chunks + (len(p.plan.aux.runset) if p.plan.aux is not None else 0)
        return TransferReport(
            mode=p.mode,
            transport=peer.link.kind,
            nbytes=p.plan.nbytes,
            chunks=chunks,
            ranges=staged_ranges if p.mode is Mode.STAGED else p.ranges,
            groups=sum(1 for g in p.groups if g.body),
            streamed=streamed,
            prepared_ahead=ahead,
            transfer_ms=(time.perf_counter() - t0) * 1e3,
            plan_ms=p.plan_ms,
            prepare_ms=p.prepare_ms,
            submit_ms=(time.perf_counter() - t_submit - run.waited) * 1e3 if direct else 0.0,
            wait_ms=run.waited * 1e3,
            cpu_ms=(time.thread_time() - cpu0) * 1e3,
            first_write_at=run.first_write[0] if run.first_write else 0.0,
            end_at=time.time(),
        )

    def _write_direct(self, peer: RemotePool, p: PreparedSend, run: "_InFlight") -> None:
        """Start each layer group's prepared write once its layers are final; on a link that
        does not land writes in order, wait until the body landed (the AUX row starts after)."""
        for g, w in zip(p.groups, p.writes):
            if w is not None:
                run.blocked(lambda: run.layers(g.layers.stop))
                run.before_write()
                run.writes.add(w.start())
        if not peer.link.ordered:
            run.blocked(run.writes.wait)

    def _write_staged(self, peer: RemotePool, p: PreparedSend, remote: RemoteSlots, run: "_InFlight") -> int:
        """The body gathered into chunks through staging slots (StagedWrite); the number of chunks."""
        streamed = run.progress is not None
        chunks = [
            dataclasses.replace(c, layers_needed=g.layers.stop if streamed else 0)
            for g in p.groups
            for c in chunk_plan(g.body, self._chunk_bytes(peer, g.body))
        ]
        staged = StagedWrite(self.endpoint, peer, remote, run)
        return staged.send(p.plan.body, chunks, share=0.5 if streamed else 1.0)

    def _write_aux(self, p: PreparedSend, run: "_InFlight") -> None:
        """The AUX row last, once the engine returned (its arrival means the body has landed;
        on an ordered link it goes behind the body), then wait until every write landed."""
        run.stall_if_injected()
        if run.progress is not None:
            run.progress.wait_complete(run.stopped, run.writes.poll)
        if p.aux is not None:
            run.before_write()
            run.writes.add(p.aux.start())
        run.blocked(run.writes.wait)


@dataclass(eq=False)
class _InFlight:
    """One send's writes in flight, what stops it, and where its time went (send()'s steps
    share it)."""

    writes: PendingWrites  # the body's writes (streamed: one per layer group) and the AUX row's
    stopped: Callable[[], bool]
    progress: LayerProgress | None  # streamed: which layers the engine has finished
    faults: FaultInjector  # the endpoint's: "send.write" before every write
    first_write: list[float] = field(default_factory=list)  # wall clock of the first body write
    waited: float = 0.0  # s blocked on layers or on the link (what submit_ms leaves out)

    def before_write(self) -> None:
        """Asked before every write (the staged writer's thread too): stopped is Cancelled."""
        if self.stopped():
            raise Cancelled("send stopped: the request was aborted")
        self.faults.check("send.write")
        if not self.first_write:
            self.first_write.append(time.time())

    def stall_if_injected(self) -> None:
        """The "send.stall" fault: the body's writes are out and this send stops here for good
        (the thread never returns), as in a producer stopped or dying mid-transfer."""
        if self.faults.hit("send.stall"):
            log.warning("injected fault at send.stall: the body's writes are out; this send stops here for good")
            threading.Event().wait()

    def layers(self, n: int, idle: Callable[[], object] | None = None) -> None:
        """Block until layers [0, n) are final (at once unless streamed), retiring what landed
        (`idle`: the staged writes' own retiring, StagedWrite)."""
        if self.progress is not None:
            self.progress.wait(n, self.stopped, idle or self.writes.poll)

    def blocked(self, wait: Callable[[], None]) -> None:
        t = time.perf_counter()
        wait()
        self.waited += time.perf_counter() - t


class StagedWrite:
    """One staged send's body, on the caller's thread (the module's docstring draws it): gather
    chunk i into a free local staging slot of `endpoint`, start its write into remote slot
    i % n (once chunk i - n's ack freed it), and gather chunk i+1 while that write is in flight;
    a write that landed is told to the receiver over the chunk channel, in order, and gives its
    local slot back."""

    def __init__(self, endpoint: PoolEndpoint, peer: RemotePool, remote: RemoteSlots, run: _InFlight):
        self.endpoint, self.peer, self.remote, self.run = endpoint, peer, remote, run
        self.free: list[int] = []  # local slots to gather into
        self.flying: deque[_ChunkWrite] = deque()  # started, not yet told, in chunk order
        self.told = 0  # chunks told to the receiver (0 .. told-1)
        self.gatherer: Gatherer | None = None  # the send's lane views (built in send())

    def send(self, body: Sequence[ComponentPlan], chunks: list[Chunk], share: float = 1.0) -> int:
        """Every chunk written and told, and the last one acked; the number of chunks. A
        streamed transfer waits for a chunk's layers before gathering it, and takes local slots
        only then, and only `share` of them (others' transfers need some meanwhile)."""
        if chunks:
            self.run.layers(chunks[0].layers_needed)
        self.gatherer = Gatherer(body, self.endpoint.tensors)
        staging, config = self.endpoint.staging, self.endpoint.config
        # no more local slots than it can use: one per chunk, and at most one gathering beyond the
        # remote slots in flight; the rest stay free for this sender's other destinations (TP 1 -> 8:
        # eight sends at once, which with all slots each ran one after the other)
        want = max(1, min(int(config.staging_slots * share), len(chunks), len(self.remote.slots) + 1))
        local_slots = staging.lease.acquire(want, timeout=config.chunk_timeout_s)
        if not local_slots:
            raise StagingError("no local staging slot freed up in time")
        self.free = list(local_slots)
        try:
            for i, chunk in enumerate(chunks):
                self._write(i, chunk)
            self._tell_landed(len(chunks))
            if chunks:
                self._await_ack(len(chunks) - 1)
        except BaseException:
            self._drain()  # no write reads a local slot once it is released
            raise
        finally:
            staging.lease.release(local_slots)
            self.remote.channel.end(self.remote.transfer_id)
        return len(chunks)

    def _write(self, i: int, chunk: Chunk) -> None:
        """Gather chunk i and start its write (telling what landed meanwhile)."""
        remote, peer, staging = self.remote, self.peer, self.endpoint.staging
        n_remote = len(remote.slots)
        self.run.layers(chunk.layers_needed, self._tell_landed)
        if not self.free:  # every local slot is in flight: the oldest must land first
            self._tell_landed(self.told + 1)
        slot = self.free.pop()
        self.gatherer.gather(chunk, staging.slot(slot))
        if i >= n_remote:  # the remote slot is reused: wait until its last chunk was scattered
            self._tell_landed(i - n_remote + 1)
            self._await_ack(i - n_remote)
        else:
            self._tell_landed()
        into = remote.slots[i % n_remote]
        self.run.before_write()
        pending = peer.link.write_async(
            Ranges.one(
                self.endpoint.staging_region,
                staging.slot_offset(slot),
                peer.staging.region,
                peer.slot_offset(into),
                chunk.nbytes,
            )
        )
        self.flying.append(_ChunkWrite(i, slot, into, chunk, pending))

    def _tell_landed(self, upto: int = 0) -> None:
        """Tell the receiver every chunk whose write landed, in order, and free its local slot;
        wait for the writes of chunks below `upto` (0: wait for none)."""
        while self.flying:
            w = self.flying[0]
            if w.index >= upto and not w.pending.poll():
                return
            w.pending.wait()
            self.flying.popleft()
            self.remote.channel.notify(self.remote.transfer_id, w.index, w.into, list(w.chunk.pieces))
            self.told = w.index + 1
            self.free.append(w.slot)

    def _drain(self) -> None:
        """After a failure: wait until no write of ours is in flight, whatever became of them;
        WritesAbandoned (what was given up on may still land) is what the caller must hear."""
        flying = PendingWrites()
        for w in self.flying:
            flying.add(w.pending)
        self.flying.clear()
        flying.drain()

    def _await_ack(self, index: int) -> None:
        """The chunk channel's ack of chunk `index`, waited for in short slices: an aborted
        request (whose receiver stopped acking) ends the wait now, not after the whole chunk
        timeout."""
        channel, transfer_id, stopped = self.remote.channel, self.remote.transfer_id, self.run.stopped
        timeout = self.endpoint.config.chunk_timeout_s
        give_up = time.monotonic() + timeout
        while True:
            try:
                return channel.wait_done(transfer_id, index, min(0.2, max(0.0, give_up - time.monotonic())))
            except AckTimeout:
                if stopped():
                    raise Cancelled("send stopped while waiting for an ack: the request was aborted") from None
                if time.monotonic() >= give_up:
                    raise AckTimeout(
                        f"transfer {transfer_id}: no ack for chunk {index} within {timeout} s ({self._heard(index)})"
                    ) from None

    def _heard(self, index: int) -> str:
        """What the receiver said before it went quiet, for the AckTimeout: no ack at all (a
        lost notice, a stopped receiver loop, a first chunk refused) reads differently from
        acks that stopped at chunk k (chunk k + 1 refused or its scatter stuck). The channel
        keeps no history to ask, so a wait of 0 s per chunk below `index` asks (failure path only)."""
        channel, transfer_id = self.remote.channel, self.remote.transfer_id
        for k in range(index - 1, -1, -1):
            try:
                channel.wait_done(transfer_id, k, 0.0)
            except AckTimeout:
                continue
            return f"{self.told} chunks told, acks heard up to chunk {k}"
        return f"{self.told} chunks told, no ack heard"


@dataclass(frozen=True)
class _ChunkWrite:
    """A staged chunk's write in flight: chunk `index`, from local slot `slot` into remote slot `into`."""

    index: int
    slot: int
    into: int
    chunk: Chunk
    pending: PendingWrite
