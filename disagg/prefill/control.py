"""The prefill's control socket: one I/O thread owns the ROUTER (one DEALER per decode peer)
and the outbox's PULL end; everything else sends through the outbox.

    RegisterDecode   -> Registered | Refused        (version, layout, buffers checked)
    TransferRequest  -> (a transfer, later)  | TransferDone(fail) when refused or already ended
    ChunkDone        -> the staged sender's credit
    Abort            -> the request fails; TransferDone(fail) at once if nothing is writing
    Heartbeat        -> Heartbeat | Refused (a peer we dropped must register again)

Once a second, a sweep drops decode peers silent for dead_after_s (failing exactly their
requests) and TransferRequests whose prefill never came.
"""

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import zmq

from disagg.control.chunk_relay import ChunkRelay
from disagg.control.phases import KVPoll, TransferState
from disagg.control.messages import (Abort, ChunkDone, Heartbeat, RegisterDecode, Registered, Refused, TransferDone,
                                     TransferRequest, check_version, encoder, indices_from_wire, layout_difference)
from disagg.errors import ProtocolError
from kvpool import IndexSet, RequestKV
from transfer.errors import TransferError
from transfer.peer import RemotePool

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillRequest:
    room: int
    state: TransferState
    created: float = field(default_factory=time.monotonic)
    tokens: np.ndarray | None = None        # None: decode's TransferRequest came first
    req: RequestKV | None = None
    dst: IndexSet | None = None
    peer: bytes | None = None
    slots: list[int] = field(default_factory=list)
    submitted: bool = False
    freed: bool = False
    told: bool = False                      # decode has its TransferDone(fail) already
    timings: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)


@dataclass(eq=False)
class DecodePeer:
    target: RemotePool            # the link over the transport picked for this peer
    epoch: int
    relay: ChunkRelay
    workers: ThreadPoolExecutor   # this destination's shard: a slow peer stalls only itself
    last_seen: float = field(default_factory=time.monotonic)


class PrefillControl:
    """Mixed into PrefillServer (its attributes: _router, _outbox, _decoder, _lock, _requests,
    _peers, _ended, _stop, config, epoch, layout)."""

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox.pull, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        while not self._stop.is_set():
            events = dict(poller.poll(100))
            while self._router in events and self._router.poll(0):
                frames = self._router.recv_multipart()
                if len(frames) != 2:
                    continue  # not a DEALER frame of ours
                try:
                    reply = self._handle(frames[0], frames[1])
                except Exception:  # a bug or a hostile frame must not stop the control plane
                    log.exception("control frame from %r failed", frames[0])
                    reply = None   # (a Refused would make a registered decode drop the connection)
                if reply is not None:
                    self._router.send_multipart([frames[0], encoder.encode(reply)])
            while self._outbox.pull.poll(0):
                self._router.send_multipart(self._outbox.pull.recv_multipart())
            if time.monotonic() >= next_sweep:
                try:
                    self._sweep()
                except Exception:
                    log.exception("sweep failed")
                next_sweep = time.monotonic() + 1.0

    def _handle(self, identity: bytes, frame: bytes):
        try:
            msg = self._decoder.decode(frame)
        except ProtocolError as exc:
            log.warning("control frame refused: %s", exc)
            return Refused(str(exc))
        known = self._peers.get(identity)
        if known is not None:
            known.last_seen = time.monotonic()
        match msg:
            case RegisterDecode():
                return self._register(identity, msg)
            case TransferRequest():
                return self._transfer_request(identity, msg)
            case ChunkDone(transfer_id=room, index=index):
                if known is not None:
                    known.relay.on_done(room, index)
            case Abort(room=room, reason=why):
                with self._lock:
                    r = self._requests.get(room)
                if r is None:   # nothing writes for this room
                    return TransferDone(room, self.epoch, False, f"aborted by decode: {why}")
                if r.peer != identity:   # the same decode on a new connection (it re-registered)
                    with self._lock:
                        r.state.fail(f"aborted by decode: {why}")   # terminal: it will never be submitted
                        running = r.submitted
                    if r.tokens is None:
                        self._end(r)
                    # a running transfer reports to its own connection; decode asks again later
                    return None if running else TransferDone(room, self.epoch, False, r.state.reason)
                tell = self._fail_now(r, f"aborted by decode: {why}")
                if r.tokens is None:
                    self._end(r)   # an orphan: no prefill thread will
                if tell is not None:
                    return TransferDone(room, self.epoch, False, r.state.reason)
                # else the running transfer's worker reports once it stopped writing
            case Heartbeat():
                if known is None:  # we dropped it (it went silent): it must register again
                    return Refused("unknown decode: register again")
                return Heartbeat(self.epoch)
        return None

    def _register(self, identity: bytes, msg: RegisterDecode):
        try:
            check_version(msg.version)
            diff = layout_difference(self.layout, msg.layout)
            if diff:
                raise ProtocolError(f"layout mismatch: {diff}")
            target = self.sender.connect(msg.transports, msg.layout.buffers, msg.staging)
        except (ProtocolError, TransferError) as exc:
            return Refused(str(exc))
        with self._lock:
            old = self._peers.get(identity)
            workers = old.workers if old is not None else ThreadPoolExecutor(
                self.config.transfer_workers, thread_name_prefix=f"kv-transfer-{target.link.peer}")
            self._peers[identity] = DecodePeer(target, msg.epoch, ChunkRelay(self._outbox, identity), workers)
        log.info("decode %s registered (epoch %d, %s)", target.link.peer, msg.epoch, target.link.kind)
        return Registered(self.epoch, target.link.kind)

    def _transfer_request(self, identity: bytes, msg: TransferRequest):
        room, peer = msg.room, self._peers.get(identity)
        reason = None
        if peer is None:
            reason = "decode is not registered"
        elif msg.decode_epoch != peer.epoch:
            reason = f"decode epoch {msg.decode_epoch} is not the registered {peer.epoch}"
        if reason is None:
            try:
                dst = indices_from_wire(msg.indices)
            except ProtocolError as exc:
                reason = str(exc)
        if reason is not None:
            return TransferDone(room, self.epoch, False, reason)
        with self._lock:
            r = self._requests.get(room)
            if r is None:
                ended = self._ended.reason(room)
                if ended is not None:  # this room already ended here: decode must not wait for it
                    return TransferDone(room, self.epoch, False, ended)
                r = self._requests[room] = PrefillRequest(room, TransferState(room))
            elif r.dst is not None:
                log.warning("room %d: second TransferRequest ignored", room)
                return None
            r.dst, r.peer, r.slots = dst, identity, list(msg.slots)
        try:
            r.state.advance(KVPoll.WAITING_FOR_INPUT)
        except ProtocolError:
            pass  # already ended (the prefill thread will tell decode) or already past it
        self._maybe_submit(r)
        return None

    def _sweep(self) -> None:
        """Fail exactly the requests of decode peers that went silent (no heartbeat for
        dead_after_s); drop TransferRequests whose prefill never came within waiting_s."""
        now = time.monotonic()
        with self._lock:
            dead = {i for i, p in self._peers.items() if now - p.last_seen > self.config.dead_after_s}
            for identity in dead:
                log.warning("decode %s silent for %.0f s: dropping it", self._peers[identity].target.link.peer,
                            self.config.dead_after_s)
                gone = self._peers.pop(identity)
                gone.workers.shutdown(wait=False)
                gone.target.link.close()
            lost = [r for r in self._requests.values() if r.peer in dead]
            stale = [r for r in self._requests.values()
                     if r.tokens is None and now - r.created > self.config.deadlines.waiting_s]
        for r in lost:
            r.state.fail("decode peer silent")
        for r in stale:
            tell = self._fail_now(r, "prefill never arrived")
            if tell is not None:
                self._outbox.put(tell, encoder.encode(TransferDone(r.room, self.epoch, False, r.state.reason)))
        for r in set(stale) | {r for r in lost if r.tokens is None}:
            self._end(r)
