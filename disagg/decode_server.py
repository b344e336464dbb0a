"""DecodeServer: the decode side of the control plane.

    HTTP /decode (room, tokens) -> bootstrap lookup -> register once per prefill peer
        -> alloc (SWA window only) + staging slots -> TransferRequest -> ... TransferDone
        -> verify every byte (plugin) -> decode N tokens -> free

One I/O thread owns every DEALER (one per prefill peer) and the outbox; other threads ask it
to connect or send through the outbox. ChunkLanded notices are scattered on the I/O thread
only while their room is live; TransferDone completes exactly its own room, from the epoch
of the prefill it registered with. A request that fails after its TransferRequest went out
is not freed until prefill confirms it stopped writing (TransferDone) or a cap passes: a
late write can never land in pages that another request owns.
"""

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from disagg.bootstrap import BootstrapClient
from disagg.kv_state import KVPoll, TransferState
from disagg.outbox import Outbox
from disagg.prefill_server import PoolSettings
from disagg.protocol import (PROTOCOL_VERSION, Abort, Decoder, Heartbeat, RegisterDecode, RegisterPrefill,
                             Registered, Refused, ToDecode, TransferDone, TransferRequest, encoder,
                             indices_to_wire, layout_difference, layout_info, to_wire)
from disagg.standin import EnginePlugin, StandInEngine, VerifyError
from kvpool import HybridPool, IndexSet, KVPoolError, RequestKV
from transfer.config import TransferConfig
from transfer.engine import MooncakeEngine
from transfer.errors import DisaggError, ProtocolError, StagingError
from transfer.receiver import KVReceiver
from transfer.staging import ChunkLanded

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig:
    pool: PoolSettings = PoolSettings()
    host: str = "127.0.0.1"
    protocol: str = "tcp"                   # Mooncake transport: tcp or rdma
    rdma_devices: str = ""                  # NIC names for rdma ("" = all)
    bootstrap_addr: str = "tcp://127.0.0.1:8998"
    transfer: TransferConfig = field(default_factory=TransferConfig)
    slots_per_transfer: int = 2
    request_timeout_s: float = 30.0
    register_timeout_s: float = 10.0
    # A failed request whose TransferRequest went out keeps its pages until that prefill says
    # TransferDone (it stopped writing), or at the latest this long: beyond Mooncake's own
    # 30 s retention of in-flight slices.
    quarantine_s: float = 60.0
    heartbeat_interval_s: float = 1.0     # to every registered prefill
    dead_after_s: float = 5.0             # silence after which a prefill's requests fail


@dataclass(eq=False)
class _Peer:
    info: RegisterPrefill
    registered: threading.Event = field(default_factory=threading.Event)
    refused: str = ""
    epoch: int = 0
    last_seen: float = field(default_factory=time.monotonic)


@dataclass(eq=False)
class _Request:
    room: int
    state: TransferState
    endpoint: str
    req: RequestKV
    dst: IndexSet
    slots: list[int]
    done: TransferDone | None = None
    kv_ready_at: float = 0.0   # wall clock when TransferDone arrived
    sent: bool = False         # TransferRequest went out: prefill may be writing into req
    released: threading.Event = field(default_factory=threading.Event)  # prefill said TransferDone


class DecodeServer:
    def __init__(self, config: DecodeConfig, plugin: EnginePlugin | None = None):
        self.config = config
        self.plugin = plugin or StandInEngine()
        self.pool = HybridPool(config.pool.pool_config())
        self.engine = MooncakeEngine(config.host, config.protocol, config.rdma_devices)
        self.receiver = KVReceiver(self.engine, self.pool, config.transfer)
        self.epoch = time.time_ns()
        self.layout = layout_info(self.pool.page_size, self.pool.config.layout.value, self.pool.buffer_descriptors())
        self._ctx = zmq.Context()
        self._outbox = Outbox(self._ctx)
        self._decoder = Decoder(ToDecode, "decode control")
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}             # control endpoint -> peer
        self._dealers: dict[str, zmq.Socket] = {}      # I/O thread only
        self._requests: dict[int, _Request] = {}
        self._quarantine: dict[int, tuple[_Request, float]] = {}   # room -> (request, give up at)
        self._lookups: dict[tuple[str, int], RegisterPrefill] = {}
        self._stop = threading.Event()
        self._io = threading.Thread(target=self._io_loop, name="decode-io", daemon=True)
        self._io.start()
        self.ready = True

    # ---- the request path (HTTP handler threads) ---------------------------------------------
    def _peer_for(self, bootstrap: str, tp_rank: int = 0) -> _Peer:
        info = self._lookups.get((bootstrap, tp_rank))
        if info is None:
            client = BootstrapClient(bootstrap, context=self._ctx)
            try:
                info = client.lookup(PROTOCOL_VERSION, tp_rank)
            finally:
                client.close()
            diff = layout_difference(self.layout, info.layout)
            if diff:
                raise ProtocolError(f"prefill layout differs: {diff}")
            self._lookups[(bootstrap, tp_rank)] = info
        with self._lock:
            peer = self._peers.get(info.control_endpoint)
            fresh = peer is None or peer.info.epoch != info.epoch
            if fresh:
                peer = self._peers[info.control_endpoint] = _Peer(info)
        if fresh:
            register = RegisterDecode(PROTOCOL_VERSION, self.epoch, self.engine.session_id, self.layout,
                                      to_wire(self.pool.buffer_descriptors()), self.receiver.staging.ptr,
                                      self.receiver.staging.num_slots, self.receiver.staging.slot_bytes)
            self._outbox.put(b"connect", info.control_endpoint.encode(), encoder.encode(register))
        if not peer.registered.wait(self.config.register_timeout_s):
            raise ProtocolError(f"prefill {info.control_endpoint} did not answer the registration")
        if peer.refused:
            raise ProtocolError(f"prefill refused registration: {peer.refused}")
        return peer

    def decode(self, room: int, token_ids: np.ndarray, max_new_tokens: int = 1, bootstrap: str | None = None) -> dict:
        t0 = time.perf_counter()
        tokens = np.asarray(token_ids, dtype=np.int64)
        timings: dict = {}
        state = TransferState(room)
        r = None
        try:
            peer = self._peer_for(bootstrap or self.config.bootstrap_addr)
            timings["bootstrap_ms"] = (time.perf_counter() - t0) * 1e3
            req = self.pool.alloc_request(len(tokens), swa_window_only=True)
            slots = self.receiver.reserve_slots(self.config.slots_per_transfer)
            r = _Request(room, state, peer.info.control_endpoint, req, self.pool.index_set(req), slots)
            with self._lock:
                if room in self._requests:
                    raise ProtocolError(f"duplicate room {room}")
                self._requests[room] = r
            state.advance(KVPoll.WAITING_FOR_INPUT)
            t1 = time.perf_counter()
            r.sent = True
            self._outbox.put(b"send", peer.info.control_endpoint.encode(), encoder.encode(
                TransferRequest(room, self.epoch, len(tokens), indices_to_wire(r.dst), slots)))
            state.advance(KVPoll.TRANSFERRING)
            final = state.wait(self.config.request_timeout_s)
            if not final.terminal and state.fail(f"deadline {self.config.request_timeout_s} s passed waiting for KV"):
                self._outbox.put(b"send", r.endpoint.encode(), encoder.encode(Abort(room, state.reason)))
            timings["wait_ms"] = (time.perf_counter() - t1) * 1e3
            if state.poll() is KVPoll.SUCCESS:
                t2 = time.perf_counter()
                digests = self.plugin.verify(self.pool, req, tokens, room)
                timings["verify_ms"] = (time.perf_counter() - t2) * 1e3
                t3 = time.perf_counter()
                output = self.plugin.decode(self.pool, req, tokens, max_new_tokens)
                timings["decode_ms"] = (time.perf_counter() - t3) * 1e3
                done = r.done
                return {"room": room, "state": "SUCCESS", "verified": True, "digests": digests,
                        "output_tokens": output, "bytes": done.nbytes, "mode": done.mode,
                        "ranges": done.ranges, "transfer_ms": done.transfer_ms, "kv_ready_at": r.kv_ready_at,
                        **timings}
            return {"room": room, "state": "FAILED", "verified": False, "reason": state.reason, **timings}
        except VerifyError as exc:
            return {"room": room, "state": "FAILED", "verified": False, "reason": f"verify: {exc}", **timings}
        except (DisaggError, KVPoolError) as exc:
            state.fail(str(exc))
            return {"room": room, "state": "FAILED", "verified": False, "reason": f"{type(exc).__name__}: {exc}",
                    **timings}
        finally:
            if r is not None:
                self._finish(r)

    def _finish(self, r: _Request) -> None:
        """Free now, unless prefill may still be writing into the request's pages: a failed
        request whose TransferRequest went out waits in quarantine for prefill's TransferDone."""
        with self._lock:
            if self._requests.get(r.room) is r:  # a duplicate room must not evict the live one
                del self._requests[r.room]
            if r.sent and r.state.poll() is not KVPoll.SUCCESS and not r.released.is_set():
                self._quarantine[r.room] = (r, time.monotonic() + self.config.quarantine_s)
                return
        self._release(r)

    def _release(self, r: _Request) -> None:
        self.pool.free_request(r.req)
        self.receiver.release_slots(r.slots)

    def _sweep_quarantine(self, room: int | None = None) -> None:
        """Release quarantined requests whose prefill ended (room given) or whose cap passed."""
        now = time.monotonic()
        with self._lock:
            done = [room] if room in self._quarantine else []
            done += [k for k, (_, until) in self._quarantine.items() if until <= now and k != room]
            items = [self._quarantine.pop(k) for k in done]
        for r, until in items:
            if until <= now:
                log.warning("room %d: released from quarantine after %.0f s without word from prefill",
                            r.room, self.config.quarantine_s)
            self._release(r)

    def quarantined(self) -> int:
        with self._lock:
            return len(self._quarantine)

    # ---- the control sockets (I/O thread) -----------------------------------------------------
    def _io_loop(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._outbox.pull, zmq.POLLIN)
        next_sweep = time.monotonic() + 1.0
        next_beat = time.monotonic() + self.config.heartbeat_interval_s
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_sweep:
                self._sweep_quarantine()
                next_sweep = now + 1.0
            if now >= next_beat:
                self._heartbeat(now)
                next_beat = now + self.config.heartbeat_interval_s
            events = dict(poller.poll(100))
            for endpoint, sock in list(self._dealers.items()):
                while self._dealers.get(endpoint) is sock and sock in events and sock.poll(0):
                    reply = self._handle(endpoint, sock.recv())
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
        """(I/O thread.) Fail exactly the requests with this prefill and close its socket; the
        next request looks it up and registers again (a restarted prefill has a new epoch and
        maybe a new address)."""
        with self._lock:
            self._peers.pop(endpoint, None)
            for key in [k for k, info in self._lookups.items() if info.control_endpoint == endpoint]:
                del self._lookups[key]
            victims = [r for r in self._requests.values() if r.endpoint == endpoint]
        log.warning("%s: failing %d request(s)", reason, len(victims))
        for r in victims:
            r.state.fail(reason)  # pages stay quarantined until the cap: a frozen peer may resume
        sock = self._dealers.pop(endpoint, None)  # I/O thread: a new registration connects afresh
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
            case Registered(epoch=epoch) if peer is not None:
                peer.epoch = epoch
                peer.registered.set()
            case Refused(reason=reason) if peer is not None and not peer.registered.is_set():
                peer.refused = reason
                peer.registered.set()
            case Refused(reason=reason) if peer is not None:
                self._peer_lost(endpoint, f"prefill {endpoint} dropped us: {reason}")
            case ChunkLanded(transfer_id=room):
                with self._lock:
                    r = self._requests.get(room)
                if r is None or r.endpoint != endpoint or r.state.poll().terminal:
                    return None  # not ours (any more): never scatter into freed pages
                try:
                    return self.receiver.on_chunk(msg, r.dst, r.slots)
                except StagingError as exc:
                    if r.state.fail(f"bad chunk: {exc}"):
                        return Abort(room, r.state.reason)
            case TransferDone(room=room, prefill_epoch=epoch):
                with self._lock:
                    r = self._requests.get(room)
                    parked = self._quarantine.get(room)
                if parked is not None and parked[0].endpoint == endpoint:
                    self._sweep_quarantine(room)  # prefill stopped writing: the pages are ours again
                    return None
                if r is None or r.endpoint != endpoint or peer is None or epoch != peer.epoch:
                    return None
                r.released.set()
                if msg.ok:
                    r.done = msg
                    r.kv_ready_at = time.time()
                    try:
                        r.state.complete(room)
                    except ProtocolError as exc:
                        log.warning("room %d: %s", room, exc)
                else:
                    r.state.fail(f"prefill: {msg.reason}")
            case Heartbeat():
                return None
        return None

    def bootstrap_reachable(self, timeout_s: float = 1.0) -> bool:
        """For /ready: the default bootstrap answers and knows a prefill rank."""
        client = BootstrapClient(self.config.bootstrap_addr, timeout_s, context=self._ctx)
        try:
            client.lookup(PROTOCOL_VERSION)
            return True
        except ProtocolError:
            return False
        finally:
            client.close()

    def close(self) -> None:
        self._stop.set()
        self._io.join()
        for sock in self._dealers.values():
            sock.close(linger=0)
        self.receiver.close()
        self._outbox.close()
        self._ctx.term()
