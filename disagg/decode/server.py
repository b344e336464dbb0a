"""DecodeServer: the decode side of the control plane (request path; the control sockets are
in decode_control).

    HTTP /decode (room, tokens) -> bootstrap lookup -> register once per prefill peer
        -> admit: alloc (SWA window only) + staging slots -> TransferRequest
        -> TransferStarted -> ... TransferDone -> verify every byte (plugin) -> decode N -> free

Each phase has its own deadline (kv_state). A request that fails after its TransferRequest
went out tells prefill (Abort) and is not freed until prefill confirms it stopped writing
(TransferDone) or a cap passes: a late write can never land in pages another request owns.
"""

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from disagg.control.admission import Admission, empty_pool_fit
from disagg.bootstrap.server import BootstrapClient
from disagg.decode.control import DecodeControl, DecodeRequest, PrefillPeer
from disagg.control.phases import Deadlines, KVPoll, TransferState
from disagg.control.outbox import Outbox
from disagg.worker.pool_settings import PoolSettings
from disagg.control.messages import (PROTOCOL_VERSION, Abort, Decoder, LayoutInfo, RegisterDecode, ToDecode,
                                     TransferRequest, encoder, indices_to_wire, layout_difference)
from disagg.engine.standin import EnginePlugin, StandInEngine, VerifyError
from disagg.control.tombstones import Tombstones
from kvpool import HybridPool, KVPoolError
from transfer.config import TransferConfig
from transfer.transports import TransportSettings, create
from disagg.errors import DisaggError, Overloaded, ProtocolError
from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig:
    pool: PoolSettings = PoolSettings()
    host: str = "127.0.0.1"
    transports: tuple[str, ...] = ("mooncake",)   # offered to prefill in this order of preference
    transport_settings: TransportSettings = TransportSettings()
    bootstrap_addr: str = "tcp://127.0.0.1:8998"
    transfer: TransferConfig = field(default_factory=TransferConfig)
    slots_per_transfer: int = 2
    deadlines: Deadlines = field(default_factory=Deadlines)
    # A failed request whose TransferRequest went out keeps its pages until that prefill says
    # TransferDone (it stopped writing), or at the latest this long: beyond Mooncake's own
    # 30 s retention of in-flight slices.
    quarantine_s: float = 60.0
    heartbeat_interval_s: float = 1.0     # to every registered prefill
    dead_after_s: float = 5.0             # silence after which a prefill's requests fail
    queue_wait_s: float = 5.0             # longest wait for pool space before refusing
    max_waiting: int = 64                 # requests waiting for pool space; more are refused at once


class DecodeServer(DecodeControl):
    def __init__(self, config: DecodeConfig, plugin: EnginePlugin | None = None):
        self.config = config
        self.plugin = plugin or StandInEngine()
        self.pool = HybridPool(config.pool.pool_config())
        self.admission = Admission(empty_pool_fit(self.pool, True), config.max_waiting, config.queue_wait_s)
        self.receiver = KVReceiver(create(config.transports, config.transport_settings), self.pool, config.transfer)
        self.faults = self.receiver.faults
        self.epoch = time.time_ns()
        self.layout = LayoutInfo(self.pool.page_size, self.pool.config.layout.value, self.receiver.buffers)
        self._ctx = zmq.Context()
        self._outbox = Outbox(self._ctx)
        self._decoder = Decoder(ToDecode, "decode control")
        self._lock = threading.Lock()
        self._peers: dict[str, PrefillPeer] = {}       # control endpoint -> peer
        self._dealers: dict[str, zmq.Socket] = {}      # I/O thread only
        self._requests: dict[int, DecodeRequest] = {}
        self._quarantine: dict[int, tuple[DecodeRequest, float]] = {}   # room -> (request, give up at)
        self._lookups = {}
        self._ended = Tombstones(ttl_s=config.deadlines.bootstrap_s + config.deadlines.waiting_s)
        self._stop = threading.Event()
        self._io = threading.Thread(target=self._io_loop, name="decode-io", daemon=True)
        self._io.start()
        self.ready = True

    # ---- the request path (HTTP handler threads) ---------------------------------------------
    def _peer_for(self, bootstrap: str, deadline: float, tp_rank: int = 0) -> PrefillPeer:
        info = self._lookups.get((bootstrap, tp_rank))
        if info is None:
            client = BootstrapClient(bootstrap, max(0.05, deadline - time.monotonic()), context=self._ctx)
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
                peer = self._peers[info.control_endpoint] = PrefillPeer(info)
        if fresh:
            register = RegisterDecode(PROTOCOL_VERSION, self.epoch, self.layout, self.receiver.offers(),
                                      self.receiver.staging_info())
            self._outbox.put(b"connect", info.control_endpoint.encode(), encoder.encode(register))
        if not peer.registered.wait(max(0.0, deadline - time.monotonic())):
            raise ProtocolError(f"prefill {info.control_endpoint} did not answer the registration in time")
        if peer.refused:
            raise ProtocolError(f"prefill refused registration: {peer.refused}")
        return peer

    def _admit(self, r: DecodeRequest, num_tokens: int, deadline: float) -> None:
        def alloc():
            if self.faults.hit("decode.alloc"):
                raise KVPoolError("injected fault at decode.alloc")
            return self.pool.alloc_request(num_tokens, swa_window_only=True)
        req = self.admission.admit(num_tokens, alloc, deadline)
        with self._lock:
            r.req, r.dst = req, self.pool.index_set(req)
            r.slots = self.receiver.reserve_slots(self.config.slots_per_transfer)

    def decode(self, room: int, token_ids: np.ndarray, max_new_tokens: int = 1, bootstrap: str | None = None) -> dict:
        """Receive the prompt's KV from prefill, verify it, decode. Returns the outcome with
        timings; raises Overloaded (pool full past queue_wait_s) or TooLarge after cleanup."""
        t0 = time.perf_counter()
        tokens = np.asarray(token_ids, dtype=np.int64)
        timings: dict = {}
        state = TransferState(room)
        r = DecodeRequest(room, state)
        with self._lock:
            if room in self._requests or room in self._quarantine:  # refused; the one with this room goes on
                return {"room": room, "state": "FAILED", "verified": False,
                        "reason": f"ProtocolError: duplicate room {room}"}
            self._requests[room] = r
            ended = self._ended.reason(room)
        try:
            if ended:
                state.fail(ended)
            deadline = time.monotonic() + self.config.deadlines.bootstrap_s
            peer = self._peer_for(bootstrap or self.config.bootstrap_addr, deadline)
            r.endpoint = peer.info.control_endpoint
            timings["bootstrap_ms"] = (time.perf_counter() - t0) * 1e3
            self._admit(r, len(tokens), deadline)
            t1 = time.perf_counter()
            request = encoder.encode(TransferRequest(room, self.epoch, len(tokens), indices_to_wire(r.dst), r.slots))
            with self._lock:  # an abort may have come meanwhile: then nothing goes out
                if not state.poll().terminal:
                    state.advance(KVPoll.WAITING_FOR_INPUT)
                    r.sent = True
            if r.sent:
                self._outbox.put(b"send", r.endpoint.encode(), request)
            state.wait_phased(self.config.deadlines, "decode")
            timings["wait_ms"] = (time.perf_counter() - t1) * 1e3
            if state.poll() is KVPoll.SUCCESS:
                t2 = time.perf_counter()
                digests = self.plugin.verify(self.pool, r.req, tokens, room)
                timings["verify_ms"] = (time.perf_counter() - t2) * 1e3
                t3 = time.perf_counter()
                output = self.plugin.decode(self.pool, r.req, tokens, max_new_tokens)
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
            state.fail(f"{type(exc).__name__}: {exc}")
            if isinstance(exc, (Overloaded, ValueError)):
                raise  # HTTP 503 / 400, after the cleanup below
            return {"room": room, "state": "FAILED", "verified": False, "reason": f"{type(exc).__name__}: {exc}",
                    **timings}
        finally:
            self._finish(r)

    def abort(self, room: int, reason: str) -> dict:
        """Abort a room (router, client or operator): it fails now, prefill is told, and its
        pages come back once prefill confirms. An unknown room is remembered as aborted."""
        why = f"aborted: {reason}"
        with self._lock:
            r = self._requests.get(room)
            if r is None:
                self._ended.bury(room, why)
                return {"room": room, "aborted": False, "known": False}
        return {"room": room, "aborted": r.state.fail(why), "known": True}

    def _finish(self, r: DecodeRequest) -> None:
        """Free now, unless prefill may still be writing into the request's pages: a failed
        request whose TransferRequest went out tells prefill and waits in quarantine for its
        TransferDone."""
        with self._lock:
            if self._requests.get(r.room) is r:  # a duplicate room must not evict the live one
                del self._requests[r.room]
            hold = r.sent and r.state.poll() is not KVPoll.SUCCESS and not r.released.is_set()
            if hold:
                self._quarantine[r.room] = (r, time.monotonic() + self.config.quarantine_s)
        if hold:
            self._outbox.put(b"send", r.endpoint.encode(), encoder.encode(Abort(r.room, r.state.reason)))
        else:
            self._release(r)

    def _release(self, r: DecodeRequest) -> None:
        if r.req is not None:
            self.pool.free_request(r.req)
        self.receiver.release_slots(r.slots)
        self.admission.released()

    def quarantined(self) -> int:
        with self._lock:
            return len(self._quarantine)

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
        for t in self.receiver.transports:
            t.close()
        self._outbox.close()
        self._ctx.term()
