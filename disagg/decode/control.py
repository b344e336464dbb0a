"""The decode's control sockets: one I/O thread owns every DEALER (one per prefill peer) and
the outbox's PULL end; other threads ask it to connect or send through the outbox.

    Registered / Refused   the answer to our RegisterDecode
    TransferStarted        WAITING_FOR_INPUT -> TRANSFERRING for exactly its room
    ChunkLanded            scattered only while its room is live (never into freed pages)
    TransferDone           completes exactly its own room, from the epoch we registered with;
                           for a quarantined room: prefill stopped writing, the pages are free
    Heartbeat              the peer is alive

It beats every registered prefill every heartbeat_interval_s and declares one lost after
dead_after_s of silence (failing exactly its requests); once a second it releases quarantined
requests whose cap passed.
"""

import logging
import threading
import time
from dataclasses import dataclass, field

import zmq

from disagg.control.phases import KVPoll, TransferState
from disagg.control.messages import (Abort, ChunkDone, ChunkLanded, Heartbeat, RegisterPrefill, Registered, Refused,
                                     TransferDone, TransferStarted, encoder)
from disagg.errors import ProtocolError
from kvpool import IndexSet, RequestKV
from transfer.errors import StagingError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class PrefillPeer:
    info: RegisterPrefill
    registered: threading.Event = field(default_factory=threading.Event)
    refused: str = ""
    epoch: int = 0
    transport: str = ""              # the transport prefill picked for us
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class DecodeRequest:
    room: int
    state: TransferState
    endpoint: str = ""                # the prefill's control endpoint, once looked up
    req: RequestKV | None = None      # set on admission
    dst: IndexSet | None = None
    slots: list[int] = field(default_factory=list)
    done: TransferDone | None = None
    kv_ready_at: float = 0.0   # wall clock when TransferDone arrived
    sent: bool = False         # TransferRequest went out: prefill may be writing into req
    released: threading.Event = field(default_factory=threading.Event)  # prefill said TransferDone


class DecodeControl:
    """Mixed into DecodeServer (its attributes: _ctx, _outbox, _decoder, _lock, _peers,
    _dealers, _requests, _quarantine, _lookups, _stop, receiver, config, epoch)."""

    def _io_loop(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._outbox.pull, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        next_beat = time.monotonic() + self.config.heartbeat_interval_s
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_sweep:
                try:
                    self._sweep_quarantine()
                except Exception:
                    log.exception("quarantine sweep failed")
                next_sweep = now + 1.0
            if now >= next_beat:
                self._heartbeat(now)
                next_beat = now + self.config.heartbeat_interval_s
            events = dict(poller.poll(100))
            for endpoint, sock in list(self._dealers.items()):
                while self._dealers.get(endpoint) is sock and sock in events and sock.poll(0):
                    try:
                        reply = self._handle(endpoint, sock.recv())
                    except Exception:  # a bug or a hostile frame must not stop the control plane
                        log.exception("frame from %s failed", endpoint)
                        reply = None
                    if reply is not None:
                        sock.send(encoder.encode(reply))
            while self._outbox.pull.poll(0):
                kind, endpoint, payload = self._outbox.pull.recv_multipart()
                endpoint = endpoint.decode()
                if kind == b"connect" and endpoint not in self._dealers:
                    sock = self._ctx.socket(zmq.DEALER)
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(endpoint)
                    self._dealers[endpoint] = sock
                    poller.register(sock, zmq.POLLIN)
                sock = self._dealers.get(endpoint)
                if sock is not None:
                    sock.send(payload)

    def _sweep_quarantine(self, room: int | None = None) -> None:
        """Release quarantined requests whose prefill ended (room given) or whose cap passed;
        ask again (Abort) about the others: an Abort or its TransferDone may have been lost,
        and prefill answers an Abort for a room it no longer has at once."""
        now = time.monotonic()
        with self._lock:
            done = [room] if room in self._quarantine else []
            done += [k for k, (_, until) in self._quarantine.items() if until <= now and k != room]
            items = [self._quarantine.pop(k) for k in done]
            ask = [r for r, _ in self._quarantine.values()] if room is None else []
        for r in ask:
            sock = self._dealers.get(r.endpoint)
            if sock is not None:
                sock.send(encoder.encode(Abort(r.room, r.state.reason)))
        for r, until in items:
            if until <= now:
                log.warning("room %d: released from quarantine after %.0f s without word from prefill",
                            r.room, self.config.quarantine_s)
            self._release(r)

    def _heartbeat(self, now: float) -> None:
        """Beat every registered prefill; declare one dead after dead_after_s of silence."""
        beat = encoder.encode(Heartbeat(self.epoch))
        for endpoint, peer in list(self._peers.items()):
            if not peer.registered.is_set() or peer.refused:
                continue
            if now - peer.last_seen > self.config.dead_after_s:
                self._peer_lost(endpoint, f"prefill {endpoint} silent for {self.config.dead_after_s:.0f} s")
                continue
            sock = self._dealers.get(endpoint)
            if sock is not None:
                sock.send(beat)

    def _peer_lost(self, endpoint: str, reason: str) -> None:
        """Fail exactly the requests with this prefill and close its socket; the next request
        looks it up and registers again (a restarted prefill has a new epoch and maybe a new
        address)."""
        with self._lock:
            self._peers.pop(endpoint, None)
            for key in [k for k, info in self._lookups.items() if info.control_endpoint == endpoint]:
                del self._lookups[key]
            victims = [r for r in self._requests.values() if r.endpoint == endpoint]
        log.warning("%s: failing %d request(s)", reason, len(victims))
        for r in victims:
            r.state.fail(reason)  # pages stay quarantined until the cap: a frozen peer may resume
        sock = self._dealers.pop(endpoint, None)  # a new registration connects afresh
        if sock is not None:
            self._poller.unregister(sock)
            sock.close(linger=0)

    def _handle(self, endpoint: str, frame: bytes):
        try:
            msg = self._decoder.decode(frame)
        except ProtocolError as exc:
            log.warning("frame from %s refused: %s", endpoint, exc)
            return None
        peer = self._peers.get(endpoint)
        if peer is not None:
            peer.last_seen = time.monotonic()
        match msg:
            case Registered(epoch=epoch, transport=transport) if peer is not None:
                peer.epoch, peer.transport = epoch, transport
                peer.registered.set()
            case Refused(reason=reason) if peer is not None and not peer.registered.is_set():
                peer.refused = reason
                peer.registered.set()
            case Refused(reason=reason) if peer is not None:
                self._peer_lost(endpoint, f"prefill {endpoint} dropped us: {reason}")
            case TransferStarted(room=room, prefill_epoch=epoch):
                r = self._live(room, endpoint, peer, epoch)
                if r is not None:
                    self._started(r)
            case ChunkLanded(transfer_id=room):
                with self._lock:
                    r = self._requests.get(room)
                if r is None or r.endpoint != endpoint or not r.sent or r.state.poll().terminal:
                    return None  # not ours (any more): never scatter into freed pages
                try:
                    self.receiver.on_chunk(msg.index, msg.slot, msg.pieces, r.dst, r.slots)
                    return ChunkDone(room, msg.index)
                except StagingError as exc:
                    r.state.fail(f"bad chunk: {exc}")   # the request thread tells prefill (Abort)
            case TransferDone(room=room, prefill_epoch=epoch):
                with self._lock:
                    parked = self._quarantine.get(room)
                if parked is not None and parked[0].endpoint == endpoint:
                    self._sweep_quarantine(room)  # prefill stopped writing: the pages are ours again
                    return None
                r = self._live(room, endpoint, peer, epoch)
                if r is None:
                    return None
                r.released.set()
                if msg.ok:
                    r.done = msg
                    r.kv_ready_at = time.time()
                    self._started(r)
                    try:
                        r.state.complete(room)
                    except ProtocolError as exc:
                        log.warning("room %d: %s", room, exc)
                else:
                    r.state.fail(f"prefill: {msg.reason}")
        return None

    def _live(self, room: int, endpoint: str, peer, epoch: int):
        """The live request this message from `endpoint` may speak about, or None."""
        with self._lock:
            r = self._requests.get(room)
        if r is None or not r.sent or r.endpoint != endpoint or peer is None or epoch != peer.epoch:
            return None
        return r

    @staticmethod
    def _started(r: DecodeRequest) -> None:
        if r.state.poll() is KVPoll.WAITING_FOR_INPUT:
            try:
                r.state.advance(KVPoll.TRANSFERRING)
            except ProtocolError:
                pass  # it ended meanwhile
