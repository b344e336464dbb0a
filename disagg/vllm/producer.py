"""The producer (prefill) side of a DisaggWorker: vLLM's finished prompts held under rooms
until their consumer ranks ask, then sent from vLLM's blocks.

    Send (scheduler step)  -> held[room]: HELD until every consumer rank that takes some of
                              our heads asked and was sent to, at most hold_s
    RegisterDecode         -> DecodePeers.register (version, layout check, a shared transport)
    TransferRequest        -> one consumer rank's destination blocks, per KV cache group,
                              cover the last blocks of its num_tokens (its own prefix-cache
                              hit is the rest; a window's last blocks, a state's slot:
                              disagg.vllm.groups): the paired source blocks go, on the peer's
                              transfer workers (of another block or TP size: by token, group
                              by group, our heads that rank holds) -> TransferStarted;
                              TransferDone (the groups' reports merged) once the
                              writes landed (or not)
    Abort                  -> that rank's send stops; the room takes no new rank (ABORTED);
                              from a connection not among the room's consumer ranks (once
                              one asked): refused, nothing changes
    a room ends            -> Handoff.sent(req_id): vLLM frees its blocks (finished_sending)

Which consumer ranks a room goes to (transfer.reshard.receivers, as our prefill server): the
first rank's request names its instance's TP size; equal TP sizes, rank r only; TP 1 -> 2
both ranks (half the heads each); 2 -> 1 rank 0 (it hears from both our ranks). A room ends
once each of those ranks' sends ended (well or not), or when its hold deadline passes or it
is aborted and no send runs; another connection's request for a rank already served, or one
from an instance of another TP size, is refused and changes nothing.

A TransferRequest may come before the step that holds its room reaches us (the consumer
heard of the room through the proxy first): it waits, at most hold_s.
The loop thread owns the control socket and `held`; transfer workers send and post
SendEnded back through the Handoff. A small send over a synchronous link (cma: a memory copy
by the calling thread, at most INLINE_BYTES, about a millisecond) is written by the loop
itself, its TransferDone the reply: every hand-over between threads waits for the GIL, which
vLLM's own thread holds through its step's Python work, and two of them (to a transfer
worker, back through the outbox) cost a small request more than its write
(disagg.vllm.hops, scripts/bench_worker_arrival.py). A send that may stall on purpose
(the send.stall fault) always goes to a worker.
"""

import enum
import logging
import threading
import time
from dataclasses import dataclass, field

from disagg.bootstrap.lease import BootstrapLease
from disagg.bootstrap.server import BootstrapConfig, BootstrapServer
from disagg.control.auth import Gate
from disagg.control.io import RouterIO
from disagg.control.layout import LayoutInfo
from disagg.control.messages import (
    PROTOCOL_VERSION,
    Abort,
    ChunkDone,
    Heartbeat,
    RegisterDecode,
    RegisterPrefill,
    Refused,
    TransferDone,
    TransferRequest,
    TransferStarted,
    indices_from_wire,
)
from disagg.errors import DisaggError, ProtocolError
from disagg.prefill.peers import DecodePeer, DecodePeers
from disagg.vllm import hops
from disagg.vllm.groups import Group, pairs, token_sends
from disagg.vllm.handoff import Handoff
from disagg.vllm.scheduler import Send, StepMeta
from disagg.vllm.settings import ConnectorSettings
from disagg.vllm.stats import End, Ended
from kvpool.geometry import Component
from kvpool.indices import IndexSet
from transfer.errors import Cancelled, TransferError, WritesAbandoned
from transfer.report import merged
from transfer.sender import KVSender, RemotePool

log = logging.getLogger(__name__)

POLL_MS = 5  # the loop's longest sleep: a step's Send waits at most this long
SWEEP_S = 0.5
TRANSFER_WORKERS = 2  # per consumer peer
INLINE_BYTES = 4 << 20  # a send over a synchronous link up to this size is written by the loop


class Phase(enum.Enum):
    HELD = "held"  # consumer ranks may (still) ask for it
    ABORTED = "aborted"  # closed by an abort: let go once no send runs
    EXPIRED = "expired"  # closed at its hold deadline: let go once no send runs


CLOSED = (Phase.ABORTED, Phase.EXPIRED)


class Delivery(enum.Enum):
    SENDING = "sending"
    STOPPING = "stopping"  # set by the loop: the send ends with Cancelled at its next write
    ENDED = "ended"  # well or not: its TransferDone went


@dataclass(eq=False)
class Dest:
    """One consumer rank a room goes to (several when the TP sizes differ)."""

    identity: bytes  # its connection
    rank: int  # its TP rank
    phase: Delivery = Delivery.SENDING
    ended: Ended | None = None  # how its send went, for the stats (None: not yet, or stopped by an abort)


@dataclass(eq=False)
class Held:
    send: Send  # its block_ids: per KV cache group, what the producer keeps
    deadline: float
    phase: Phase = Phase.HELD
    tp_size: int = 0  # the consumer instance's TP size (0: no rank asked yet)
    receivers: frozenset[int] = frozenset()  # its ranks that take some of our heads
    dests: dict[int, Dest] = field(default_factory=dict)  # consumer rank -> its send

    def sending(self) -> bool:
        return any(d.phase is not Delivery.ENDED for d in self.dests.values())

    def served(self) -> bool:
        """Every consumer rank that takes some of our heads was sent to."""
        ended = {r for r, d in self.dests.items() if d.phase is Delivery.ENDED}
        return self.tp_size > 0 and ended >= self.receivers

    def outcome(self) -> Ended | None:
        """The room's sends as one send for the stats: failed if any failed, moved (bytes summed,
        the slowest's seconds) once every rank was served, expired at the hold deadline, None
        (nothing to count) when aborted."""
        ends = [d.ended for d in self.dests.values() if d.ended is not None]
        if any(e.how is End.FAILED for e in ends):
            return Ended(End.FAILED)
        if ends and self.served():
            return Ended(End.MOVED, max(e.seconds for e in ends), sum(e.nbytes for e in ends))
        return Ended(End.EXPIRED) if self.phase is Phase.EXPIRED else None


@dataclass(frozen=True)
class SendEnded:
    room: int
    rank: int  # the consumer rank
    ended: Ended | None  # None: stopped by an abort (nothing to count)


@dataclass(frozen=True)
class Piece:
    """Our blocks and the consumer's, and the first position its blocks lack (by token)."""

    src: IndexSet
    dst: IndexSet
    prefix_len: int = 0


@dataclass(frozen=True)
class Source:
    """One send to one consumer rank: one piece of every group's block pairs, or (by token:
    another block or TP size) a piece per group, one planned send each, and the request's
    length."""

    pieces: tuple[Piece, ...]
    num_tokens: int | None = None


class Producer:
    def __init__(
        self,
        settings: ConnectorSettings,
        sender: KVSender,
        layout: LayoutInfo,
        gate: Gate,
        handoff: Handoff,
        epoch: int,
        *,
        tp: tuple[int, int],
        groups: tuple[Group, ...],
    ):
        self.settings, self.sender, self.handoff, self.epoch, self.groups = settings, sender, handoff, epoch, groups
        self.io = RouterIO(gate, settings.host)
        self.peers = DecodePeers(sender, layout, self.io, TRANSFER_WORKERS, settings.dead_after_s, epoch)
        self.held: dict[int, Held] = {}
        # what one block of each group's pages moves at most (its every buffer), for INLINE_BYTES
        self.block_bytes = sum(b.item_bytes for b in sender.endpoint.buffers)
        self.stalls = bool(sender.endpoint.faults.plan.rates.get("send.stall"))
        self.early: dict[int, dict[bytes, tuple[TransferRequest, float]]] = {}  # room -> asked before held
        rank = RegisterPrefill(PROTOCOL_VERSION, tp[1], tp[0], self.io.endpoint, epoch, layout)
        try:
            self.bootstrap = (
                BootstrapServer(BootstrapConfig(settings.bootstrap), gate, own=rank).start()
                if settings.run_bootstrap and tp[1] == 0
                else None
            )
        except BaseException:  # (its port is taken, ...): what this opened closes with it
            self.peers.close()
            self.io.close()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="disagg-producer", daemon=True)
        self._thread.start()
        self.lease = BootstrapLease(gate, settings.bootstrap, rank)
        try:
            self.lease.acquire(reach_s=settings.start_s)
        except DisaggError:
            self.close()
            raise

    # ---- the loop thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        next_sweep = time.monotonic() + SWEEP_S
        while not self._stop.is_set():
            for identity, msg in self.io.recv(POLL_MS):
                try:
                    reply = self._handle(identity, msg)
                except Exception:  # a bug or a hostile frame must not stop the control plane
                    log.exception("control frame from %r failed", identity)
                    reply = None
                if reply is not None:
                    self.io.reply(identity, reply)
            for item in self.handoff.take():
                self._event(item)
            if time.monotonic() >= next_sweep:
                self._sweep()
                next_sweep = time.monotonic() + SWEEP_S

    def _event(self, item) -> None:
        match item:
            case StepMeta(sends=sends):
                for s in sends:
                    self._hold(s)
            case SendEnded(room=room, rank=rank, ended=ended):
                self._send_ended(room, rank, ended)

    def _send_ended(self, room: int, rank: int, ended: Ended | None) -> None:
        h = self.held.get(room)
        if h is not None and rank in h.dests:
            h.dests[rank].phase, h.dests[rank].ended = Delivery.ENDED, ended
            self._maybe_let_go(room, h)

    def _maybe_let_go(self, room: int, h: Held) -> None:
        """Free the room's blocks once no send runs and it was served, aborted or is past its
        hold deadline."""
        if not h.sending() and (h.served() or h.phase in CLOSED):
            del self.held[room]
            self.handoff.sent(h.send.req_id, h.outcome())

    def _hold(self, s: Send) -> None:
        if s.room in self.held:
            log.warning(
                "room %d held twice (requests %s, %s): keeping the first",
                s.room,
                self.held[s.room].send.req_id,
                s.req_id,
            )
            self.handoff.sent(s.req_id)
            return
        if len(s.block_ids) != len(self.groups):
            log.warning(
                "room %d: blocks of %d groups, the model has %d; not held", s.room, len(s.block_ids), len(self.groups)
            )
            self.handoff.sent(s.req_id)
            return
        self.held[s.room] = Held(s, time.monotonic() + self.settings.hold_s)
        for identity, (msg, _) in self.early.pop(s.room, {}).items():
            reply = self._transfer_request(identity, msg)
            if reply is not None:
                self.io.reply(identity, reply)

    def _handle(self, identity: bytes, msg):
        """One message from a consumer -> the reply, if any."""
        if isinstance(msg, ProtocolError):
            log.warning("control frame refused: %s", msg)
            return Refused(str(msg))
        known = self.peers.heard(identity)
        match msg:
            case RegisterDecode():
                return self.peers.register(identity, msg)
            case TransferRequest():
                return self._transfer_request(identity, msg)
            case Abort(room=room, reason=why) if known:
                return self._abort(identity, room, why)
            case Heartbeat():
                return Heartbeat(self.epoch) if known else Refused("unknown decode: register again")
            case ChunkDone():
                return None  # never staged: we lend no slots
        return Refused("register first") if not known else None

    def _transfer_request(self, identity: bytes, msg: TransferRequest):
        hops.mark(msg.room, "p.asked")
        peer = self.peers.get(identity)
        if peer is None or msg.decode_epoch != peer.epoch:
            return TransferDone(msg.room, self.epoch, False, reason="decode is not registered (or not at this epoch)")
        h = self.held.get(msg.room)
        if h is None:  # its step may not have reached us yet
            self.early.setdefault(msg.room, {})[identity] = (msg, time.monotonic() + self.settings.hold_s)
            return None
        size, rank = peer.tp
        claimed = h.dests.get(rank)
        if claimed is not None and claimed.identity == identity:
            return None  # a second TransferRequest: ignored
        refusal = self._refusal(msg.room, h, size, rank, claimed)
        if refusal:  # nothing changes
            return TransferDone(msg.room, self.epoch, False, reason=refusal)
        try:
            send = self._source(h, indices_from_wire(msg.indices), msg.num_tokens, peer.target)
        except ProtocolError as exc:
            return TransferDone(msg.room, self.epoch, False, reason=str(exc))
        h.tp_size, h.receivers = size, self.peers.receivers(size)
        d = h.dests[rank] = Dest(identity, rank)
        if self._inline(peer, send):
            done, ended = self._write(h, d, peer, send)
            self._send_ended(msg.room, rank, ended)
            hops.mark(msg.room, "p.told")
            return done
        peer.workers.submit(self._send, h, d, peer, send)
        return TransferStarted(msg.room, self.epoch)

    def _inline(self, peer: DecodePeer, s: Source) -> bool:
        """Whether the loop writes this send itself (the module's docstring says when)."""
        blocks = sum(len(p.src[c]) for p in s.pieces for c in p.src.components())
        return peer.target.link.synchronous and blocks * self.block_bytes <= INLINE_BYTES and not self.stalls

    def _refusal(self, room: int, h: Held, size: int, rank: int, claimed: Dest | None) -> str:
        """Why consumer rank `rank` of an instance of TP size `size` may not have this room ("": it may)."""
        if h.phase in CLOSED:
            return f"room {room} is no longer held (aborted, or its hold deadline passed)"
        if claimed is not None:
            return f"consumer rank {rank} of room {room} is claimed by another connection"
        if h.tp_size and h.tp_size != size:
            return f"room {room} goes to a consumer instance of TP size {h.tp_size}, not {size}"
        if rank not in self.peers.receivers(size):
            return f"this producer rank holds none of consumer rank {rank}'s heads (TP size {size})"
        return ""

    def _source(self, h: Held, dst: IndexSet, num_tokens: int, target: RemotePool) -> Source:
        """What to send for a destination that covers the last blocks of the prompt's first
        `num_tokens` tokens, per group: pair by pair, or (a consumer of another block or TP
        size: `target` moves by token) our blocks of those tokens, from the first position
        its blocks hold (disagg.vllm.groups); ProtocolError for one that cannot be ours."""
        if target.lanes is None:
            src, dst_blocks = pairs(self.groups, h.send.block_ids, dst, num_tokens, h.send.num_tokens)
            return Source((Piece(IndexSet({Component.FULL: src}), IndexSet({Component.FULL: dst_blocks})),))
        sends = token_sends(
            self.groups, h.send.block_ids, dst, num_tokens, h.send.num_tokens, dst_block_size=target.page_size
        )
        return Source(
            tuple(Piece(IndexSet({t.component: t.src}), IndexSet({t.component: t.dst}), t.prefix_len) for t in sends),
            num_tokens,
        )

    def _abort(self, identity: bytes, room: int, why: str):
        """Stop the send to this connection; the room takes no new consumer rank (vLLM aborts
        a request on every rank) and is let go once no send runs. Only the room's consumer
        ranks may (a connection that asked for it, or one of the same consumer process after it
        re-registered; any registered consumer while none asked: decode may abort a request
        before its load): another's abort changes nothing, as on our prefill server."""
        h = self.held.get(room)
        if h is None:
            self.early.get(room, {}).pop(identity, None)
            return TransferDone(
                room,
                self.epoch,
                False,
                reason=f"aborted by decode: {why}",
                settled=not self.sender.endpoint.unsettled(),
            )
        if not self.peers.same_decode(identity, {d.identity for d in h.dests.values()}):
            log.warning("consumer %r tried to abort room %d of another consumer: ignored", identity, room)
            return TransferDone(room, self.epoch, False, reason="not a room of yours: nothing done")
        h.phase = Phase.ABORTED
        mine = [d for d in h.dests.values() if d.identity == identity and d.phase is Delivery.SENDING]
        for d in mine:
            d.phase = Delivery.STOPPING
        if mine:
            return None  # the send answers with TransferDone
        self._maybe_let_go(room, h)
        return TransferDone(room, self.epoch, False, reason=f"aborted by decode: {why}")

    def _sweep(self) -> None:
        now = time.monotonic()
        for room, h in list(self.held.items()):
            if h.phase is Phase.HELD and now >= h.deadline:
                missing = sorted(h.receivers - h.dests.keys())
                log.warning(
                    "room %d (request %s): %s within %g s; freeing its blocks%s",
                    room,
                    h.send.req_id,
                    f"consumer ranks {missing} did not ask" if h.dests else "no consumer asked",
                    self.settings.hold_s,
                    " once its sends end" if h.sending() else "",
                )
                h.phase = Phase.EXPIRED
                self._maybe_let_go(room, h)
        for room, asks in list(self.early.items()):
            for identity, (_, deadline) in list(asks.items()):
                if now >= deadline:
                    del asks[identity]
                    self.io.reply(identity, TransferDone(room, self.epoch, False, reason="no such room here"))
            if not asks:
                del self.early[room]
        gone = self.peers.drop_silent()
        for h in self.held.values():
            for d in h.dests.values():
                if d.identity in gone and d.phase is Delivery.SENDING:
                    d.phase = Delivery.STOPPING

    # ---- a transfer worker ---------------------------------------------------------------------
    def _send(self, h: Held, d: Dest, peer: DecodePeer, s: Source) -> None:
        done, ended = self._write(h, d, peer, s)
        # the end first: the loop's wake-up that sends `done` takes it too (as for its own
        # small sends), so vLLM hears of the send by its next step, not a poll later
        self.handoff.post(SendEnded(h.send.room, d.rank, ended))
        self.io.send(d.identity, done)
        hops.mark(h.send.room, "p.told")

    def _write(self, h: Held, d: Dest, peer: DecodePeer, s: Source) -> tuple[TransferDone, Ended | None]:
        """One consumer rank's send, start to end (a transfer worker's, or the loop's for a
        small one): its TransferDone, and how it went for the stats (None: stopped by an abort)."""
        hops.mark(h.send.room, "p.sending")
        report, reason, settled, ended = None, "", True, Ended(End.FAILED)
        t0 = time.monotonic()
        try:
            report = merged(
                self.sender.send(
                    peer.target,
                    piece.src,
                    piece.dst,
                    num_tokens=s.num_tokens,
                    prefix_len=piece.prefix_len,
                    stopped=lambda: d.phase is Delivery.STOPPING or self._stop.is_set(),
                )
                for piece in s.pieces
            )
            ended = Ended(End.MOVED, time.monotonic() - t0, report.nbytes)
            hops.mark(h.send.room, "p.written")
        except Cancelled as exc:
            reason, ended = f"aborted: {exc}", None
        except TransferError as exc:
            reason, settled = f"{type(exc).__name__}: {exc}", not isinstance(exc, WritesAbandoned)
        except Exception as exc:  # a bug: the consumer still hears the end
            log.exception("room %d: send failed", h.send.room)
            reason = f"internal error: {type(exc).__name__}"
        if report is None:  # (a failed write's bytes may still be on their way: Transport.unsettled)
            settled = settled and not self.sender.endpoint.unsettled()
        done = TransferDone(h.send.room, self.epoch, report is not None, reason=reason, report=report, settled=settled)
        return done, ended

    def wake(self) -> None:
        """From vLLM's thread, after posting a step to the Handoff: the loop takes it now."""
        self.io.wake()

    def close(self) -> None:
        self.lease.stop()
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.peers.close()
        if self.bootstrap is not None:
            self.bootstrap.stop()
        self.io.close()
