"""The producer (prefill) side of a DisaggWorker: vLLM's finished prompts held under rooms
until their consumer asks, then sent from vLLM's blocks.

    Send (scheduler step)  -> held[room]: HELD until a TransferRequest, at most hold_s
    RegisterDecode         -> DecodePeers.register (version, layout check, a shared transport)
    TransferRequest        -> the consumer's destination blocks, per KV cache group, cover the
                              last blocks of its num_tokens (its own prefix-cache hit is the
                              rest; a window's last blocks, a state's slot: disagg.vllm.groups):
                              the paired source blocks go, on the peer's transfer workers
                              -> TransferStarted; TransferDone once the writes landed (or not)
    Abort                  -> a HELD room is let go at once; a SENDING one stops
    a room ends            -> Handoff.sent(req_id): vLLM frees its blocks (finished_sending)

A TransferRequest may come before the step that holds its room reaches us (the consumer
heard of the room through the proxy first): it waits, at most hold_s.
The loop thread owns the control socket and `held`; transfer workers send and post
SendEnded back through the Handoff.
"""

import enum
import logging
import threading
import time
from dataclasses import dataclass

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
from disagg.vllm.groups import Group, pairs, token_pairs
from disagg.vllm.handoff import Handoff
from disagg.vllm.scheduler import Send, StepMeta
from disagg.vllm.settings import ConnectorSettings
from disagg.vllm.stats import End, Ended
from kvpool.geometry import Component
from kvpool.indices import IndexSet
from transfer.errors import Cancelled, TransferError, WritesAbandoned
from transfer.sender import KVSender, RemotePool

log = logging.getLogger(__name__)

POLL_MS = 5  # the loop's longest sleep: a step's Send waits at most this long
SWEEP_S = 0.5
TRANSFER_WORKERS = 2  # per consumer peer


class Phase(enum.Enum):
    HELD = "held"
    SENDING = "sending"


@dataclass(eq=False)
class Held:
    send: Send  # its block_ids: per KV cache group, what the producer keeps
    deadline: float
    phase: Phase = Phase.HELD
    owner: bytes | None = None  # the consumer it is being sent to
    stop: bool = False  # set by the loop: the send ends with Cancelled at its next write


@dataclass(frozen=True)
class SendEnded:
    room: int
    ended: Ended | None  # None: stopped by an abort (nothing to count)


@dataclass(frozen=True)
class Source:
    """One send: our blocks and the consumer's; by token (another block or TP size) also the
    request's length and the first position the consumer's blocks hold."""

    src: IndexSet
    dst: IndexSet
    num_tokens: int | None = None
    prefix_len: int = 0


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
        self.early: dict[int, tuple[bytes, TransferRequest, float]] = {}  # room -> asked before held
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
            self.lease.acquire()
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
            case SendEnded(room=room, ended=ended):
                h = self.held.pop(room, None)
                if h is not None:
                    self.handoff.sent(h.send.req_id, ended)

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
        early = self.early.pop(s.room, None)
        if early is not None:
            reply = self._transfer_request(early[0], early[1])
            if reply is not None:
                self.io.reply(early[0], reply)

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
        peer = self.peers.get(identity)
        if peer is None or msg.decode_epoch != peer.epoch:
            return TransferDone(msg.room, self.epoch, False, reason="decode is not registered (or not at this epoch)")
        h = self.held.get(msg.room)
        if h is None:  # its step may not have reached us yet
            self.early[msg.room] = (identity, msg, time.monotonic() + self.settings.hold_s)
            return None
        if h.phase is not Phase.HELD:
            return TransferDone(msg.room, self.epoch, False, reason="room is being sent to another request")
        try:
            send = self._source(h, indices_from_wire(msg.indices), msg.num_tokens, peer.target)
        except ProtocolError as exc:
            return TransferDone(msg.room, self.epoch, False, reason=str(exc))
        h.phase, h.owner = Phase.SENDING, identity
        peer.workers.submit(self._send, h, peer, identity, send)
        return TransferStarted(msg.room, self.epoch)

    def _source(self, h: Held, dst: IndexSet, num_tokens: int, target: RemotePool) -> Source:
        """What to send for a destination that covers the last blocks of the prompt's first
        `num_tokens` tokens, per group: pair by pair, or (a consumer of another block or TP
        size: `target` moves by token) our blocks of those tokens, from the first position
        its blocks hold (disagg.vllm.groups); ProtocolError for one that cannot be ours."""
        if target.lanes is None:
            src, dst_blocks = pairs(self.groups, h.send.block_ids, dst, num_tokens, h.send.num_tokens)
            return Source(IndexSet({Component.FULL: src}), IndexSet({Component.FULL: dst_blocks}))
        src, dst_blocks, first = token_pairs(
            self.groups, h.send.block_ids, dst, num_tokens, h.send.num_tokens, dst_block_size=target.page_size
        )
        return Source(IndexSet({Component.FULL: src}), IndexSet({Component.FULL: dst_blocks}), num_tokens, first)

    def _abort(self, identity: bytes, room: int, why: str):
        h = self.held.get(room)
        if h is None:
            return TransferDone(
                room,
                self.epoch,
                False,
                reason=f"aborted by decode: {why}",
                settled=not self.sender.endpoint.unsettled(),
            )
        if h.phase is Phase.SENDING:
            if h.owner == identity:
                h.stop = True  # the send answers with TransferDone
            return None
        del self.held[room]
        self.handoff.sent(h.send.req_id)
        return TransferDone(room, self.epoch, False, reason=f"aborted by decode: {why}")

    def _sweep(self) -> None:
        now = time.monotonic()
        for room, h in list(self.held.items()):
            if h.phase is Phase.HELD and now >= h.deadline:
                log.warning(
                    "room %d (request %s): no consumer asked within %g s; freeing its blocks",
                    room,
                    h.send.req_id,
                    self.settings.hold_s,
                )
                del self.held[room]
                self.handoff.sent(h.send.req_id, Ended(End.EXPIRED))
        for room, (identity, _, deadline) in list(self.early.items()):
            if now >= deadline:
                del self.early[room]
                self.io.reply(identity, TransferDone(room, self.epoch, False, reason="no such room here"))
        gone = self.peers.drop_silent()
        for h in self.held.values():
            if h.owner in gone:
                h.stop = True

    # ---- a transfer worker ---------------------------------------------------------------------
    def _send(self, h: Held, peer: DecodePeer, identity: bytes, s: Source) -> None:
        report, reason, settled, ended = None, "", True, Ended(End.FAILED)
        t0 = time.monotonic()
        try:
            report = self.sender.send(
                peer.target,
                s.src,
                s.dst,
                num_tokens=s.num_tokens,
                prefix_len=s.prefix_len,
                stopped=lambda: h.stop or self._stop.is_set(),
            )
            ended = Ended(End.MOVED, time.monotonic() - t0, report.nbytes)
        except Cancelled as exc:
            reason, ended = f"aborted: {exc}", None
        except TransferError as exc:
            reason, settled = f"{type(exc).__name__}: {exc}", not isinstance(exc, WritesAbandoned)
        except Exception as exc:  # a bug: the consumer still hears the end
            log.exception("room %d: send failed", h.send.room)
            reason = f"internal error: {type(exc).__name__}"
        self.io.send(
            identity,
            TransferDone(h.send.room, self.epoch, report is not None, reason=reason, report=report, settled=settled),
        )
        self.handoff.post(SendEnded(h.send.room, ended))

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
