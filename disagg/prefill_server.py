"""PrefillServer: the prefill side of the control plane.

    HTTP /prefill (room, tokens) --> alloc + engine.prefill --+
                                                              +--> transfer worker --> TransferDone
    control ROUTER <-- TransferRequest (room, dst indices) ---+        (KVSender.send, AUX last)

One I/O thread owns the ZMQ sockets (control ROUTER, outbox PULL). Transfers run on worker
pools sharded by destination: each decode peer has its own `transfer_workers` threads, so
requests to one peer do not queue behind each other and a slow or dead peer stalls only its
own shard; the engine's per-peer budget keeps what is in flight within Mooncake's limits. A transfer starts once both the
local prefill and the decode's destination indices are there, in either order.
"""

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import zmq

from disagg.bootstrap import BootstrapClient, BootstrapConfig, BootstrapServer
from disagg.chunk_relay import ChunkRelay
from disagg.kv_state import KVPoll, TransferState
from disagg.outbox import Outbox
from disagg.protocol import (PROTOCOL_VERSION, Abort, Decoder, Heartbeat, RegisterDecode, RegisterPrefill,
                             Registered, Refused, ToPrefill, TransferDone, TransferRequest, check_version, encoder,
                             from_wire, indices_from_wire, layout_difference, layout_info)
from disagg.standin import EnginePlugin, StandInEngine
from kvpool import HybridPool, IndexSet, KVPoolError, Layout, PoolConfig, RequestKV, get_preset
from transfer.config import TransferConfig
from transfer.engine import MooncakeEngine
from transfer.errors import DisaggError, ProtocolError
from transfer.peer import PeerTarget
from transfer.sender import KVSender
from transfer.staging import ChunkDone

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PoolSettings:
    preset: str = "tiny-hybrid"
    page_size: int | None = None        # None: the preset's default
    max_tokens: int | None = 65536
    byte_budget: int | None = None
    max_requests: int = 64
    layout: str = "page_major"
    device: str = "auto"

    def pool_config(self) -> PoolConfig:
        model = get_preset(self.preset)
        return PoolConfig(model, self.page_size or model.default_page_size, max_tokens=self.max_tokens,
                          byte_budget=self.byte_budget, max_requests=self.max_requests,
                          layout=Layout(self.layout), device=self.device)


@dataclass(frozen=True)
class PrefillConfig:
    pool: PoolSettings = PoolSettings()
    host: str = "127.0.0.1"
    protocol: str = "tcp"                   # Mooncake transport: tcp or rdma
    rdma_devices: str = ""                  # NIC names for rdma ("" = all)                 # bound and advertised (control socket, Mooncake)
    control_port: int = 0                   # 0: any free port
    bootstrap_bind: str | None = "tcp://127.0.0.1:8998"   # run the bootstrap here (None: external)
    bootstrap_addr: str | None = None       # where to register (default: our own bootstrap)
    tp_rank: int = 0
    tp_size: int = 1
    transfer_workers: int = 4               # per decode peer
    transfer: TransferConfig = field(default_factory=TransferConfig)
    request_timeout_s: float = 30.0
    dead_after_s: float = 5.0               # decode silence (no heartbeat) that fails its requests


@dataclass(eq=False)
class _Request:
    room: int
    state: TransferState
    created: float = field(default_factory=time.monotonic)
    tokens: np.ndarray | None = None
    req: RequestKV | None = None
    dst: IndexSet | None = None
    peer: bytes | None = None
    slots: list[int] = field(default_factory=list)
    submitted: bool = False
    freed: bool = False
    timings: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)


@dataclass(eq=False)
class _DecodePeer:
    target: PeerTarget
    epoch: int
    relay: ChunkRelay
    workers: ThreadPoolExecutor   # this destination's shard: a slow peer stalls only itself
    last_seen: float = field(default_factory=time.monotonic)


class PrefillServer:
    def __init__(self, config: PrefillConfig, plugin: EnginePlugin | None = None):
        self.config = config
        self.plugin = plugin or StandInEngine()
        self.pool = HybridPool(config.pool.pool_config())
        self.engine = MooncakeEngine(config.host, config.protocol, config.rdma_devices)
        self.sender = KVSender(self.engine, self.pool, config.transfer)
        self.epoch = time.time_ns()
        self.layout = layout_info(self.pool.page_size, self.pool.config.layout.value, self.pool.buffer_descriptors())
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        port = config.control_port or self._router.bind_to_random_port(f"tcp://{config.host}")
        if config.control_port:
            self._router.bind(f"tcp://{config.host}:{port}")
        self.control_endpoint = f"tcp://{config.host}:{port}"
        self._outbox = Outbox(self._ctx)
        self._decoder = Decoder(ToPrefill, "prefill control")
        self._lock = threading.Lock()
        self._requests: dict[int, _Request] = {}
        self._peers: dict[bytes, _DecodePeer] = {}
        self._stop = threading.Event()
        self.bootstrap = BootstrapServer(BootstrapConfig(config.bootstrap_bind), self._ctx).start() \
            if config.bootstrap_bind else None
        self.bootstrap_endpoint = config.bootstrap_addr or (self.bootstrap.endpoint if self.bootstrap else None)
        if self.bootstrap_endpoint is None:
            raise ValueError("give bootstrap_bind or bootstrap_addr")
        self._io = threading.Thread(target=self._io_loop, name="prefill-io", daemon=True)
        self._io.start()
        client = BootstrapClient(self.bootstrap_endpoint, context=self._ctx)
        try:
            client.register(RegisterPrefill(PROTOCOL_VERSION, config.tp_rank, config.tp_size, self.control_endpoint,
                                            self.engine.session_id, self.epoch, self.layout))
        finally:
            client.close()
        self.ready = True

    # ---- the request path (HTTP handler threads) --------------------------------------------
    def prefill(self, room: int, token_ids: np.ndarray) -> dict:
        """Compute the prompt's KV, wait for decode's destination, transfer. Returns the outcome
        with timings; the request's pool slots are free again when this returns."""
        t0 = time.perf_counter()
        with self._lock:
            r = self._requests.get(room)
            if r is not None and r.tokens is not None:
                raise ProtocolError(f"duplicate room {room}")
            if r is None:
                r = self._requests[room] = _Request(room, TransferState(room))
            r.tokens = np.asarray(token_ids, dtype=np.int64)
        req = None
        try:
            req = self.pool.alloc_request(len(r.tokens))
            self.plugin.prefill(self.pool, req, r.tokens, room)
            r.timings["prefill_ms"] = (time.perf_counter() - t0) * 1e3
            r.timings["prefill_done_at"] = time.time()  # wall clock: the router measures hand-off with it
            with self._lock:  # only now may a transfer see it: never ship half-computed KV
                r.state.advance(KVPoll.WAITING_FOR_INPUT)
                r.req, req = req, None
            self._maybe_submit(r)
        except (KVPoolError, DisaggError) as exc:
            r.state.fail(f"prefill: {exc}")
        finally:
            if req is not None:  # allocated but never handed over
                self.pool.free_request(req)
        state = r.state.wait(self.config.request_timeout_s)
        if not state.terminal:
            r.state.fail(f"deadline {self.config.request_timeout_s} s passed in {state.name}")
        with self._lock:
            if not r.submitted:
                self._free(r)
            self._requests.pop(room, None)
        return {"room": room, "state": r.state.poll().name, "reason": r.state.reason, **r.timings, **r.report}

    def _maybe_submit(self, r: _Request) -> None:
        with self._lock:
            if r.req is None or r.dst is None or r.submitted or r.state.poll().terminal:
                return
            peer = self._peers.get(r.peer)
            if peer is None:
                return
            r.submitted = True
        peer.workers.submit(self._transfer, r)

    def _transfer(self, r: _Request) -> None:
        """Send, free the request's slots, then end its state and tell decode: once anyone sees
        the outcome, the slots are already back."""
        peer = self._peers.get(r.peer)
        ok, reason, report = False, "", None
        try:
            if peer is None:
                raise ProtocolError("decode peer is not registered")
            r.state.advance(KVPoll.TRANSFERRING)
            t0 = time.perf_counter()
            report = self.sender.send(peer.target, self.pool.index_set(r.req), r.dst, r.room, r.slots, peer.relay)
            r.report = {"bytes": report.nbytes, "mode": report.mode.value, "ranges": report.ranges,
                        "transfer_ms": (time.perf_counter() - t0) * 1e3}
            ok = True
        except (DisaggError, KVPoolError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("room %d: transfer failed: %s", r.room, exc)
        finally:
            with self._lock:
                self._free(r)
            if ok:
                try:
                    r.state.complete(r.room)
                except ProtocolError:  # a deadline or an abort ended it meanwhile
                    ok, reason = False, r.state.reason
            else:
                r.state.fail(reason or "transfer failed")
            done = TransferDone(r.room, self.epoch, ok, reason)
            if ok:
                done = TransferDone(r.room, self.epoch, True, "", report.nbytes, report.mode.value, report.ranges,
                                    r.report["transfer_ms"])
            if r.peer is not None:
                self._outbox.put(r.peer, encoder.encode(done))

    def _free(self, r: _Request) -> None:
        if r.req is not None and not r.freed:
            self.pool.free_request(r.req)
            r.freed = True

    # ---- the control socket (I/O thread) ------------------------------------------------------
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
                reply = self._handle(frames[0], frames[1])
                if reply is not None:
                    self._router.send_multipart([frames[0], encoder.encode(reply)])
            while self._outbox.pull.poll(0):
                self._router.send_multipart(self._outbox.pull.recv_multipart())
            if time.monotonic() >= next_sweep:
                self._sweep()
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
                try:
                    check_version(msg.version)
                    diff = layout_difference(self.layout, msg.layout)
                    if diff:
                        raise ProtocolError(f"layout mismatch: {diff}")
                    target = PeerTarget(msg.session_id, tuple(from_wire(msg.buffers)), msg.staging_ptr,
                                        msg.staging_slots, msg.staging_slot_bytes)
                except ProtocolError as exc:
                    return Refused(str(exc))
                with self._lock:
                    old = self._peers.get(identity)
                    workers = old.workers if old is not None else ThreadPoolExecutor(
                        self.config.transfer_workers, thread_name_prefix=f"kv-transfer-{msg.session_id}")
                    self._peers[identity] = _DecodePeer(target, msg.epoch, ChunkRelay(self._outbox, identity),
                                                        workers)
                log.info("decode %s registered (epoch %d)", msg.session_id, msg.epoch)
                return Registered(self.epoch)
            case TransferRequest(room=room):
                peer = self._peers.get(identity)
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
                        r = self._requests[room] = _Request(room, TransferState(room))
                    elif r.dst is not None:
                        log.warning("room %d: second TransferRequest ignored", room)
                        return None
                    r.dst, r.peer, r.slots = dst, identity, list(msg.slots)
                self._maybe_submit(r)
                return None
            case ChunkDone(transfer_id=room, index=index):
                peer = self._peers.get(identity)
                if peer is not None:
                    peer.relay.on_done(room, index)
                return None
            case Abort(room=room, reason=why):
                with self._lock:
                    r = self._requests.get(room)
                    running = r is not None and r.submitted
                if r is not None and r.peer == identity:
                    r.state.fail(f"aborted by decode: {why}")
                if not running:  # no transfer will write: decode may free at once
                    return TransferDone(room, self.epoch, False, f"aborted by decode: {why}")
                return None  # the running transfer's worker reports when it stops
            case Heartbeat():
                if known is None:  # we dropped it (it went silent): it must register again
                    return Refused("unknown decode: register again")
                return Heartbeat(self.epoch)
        return None

    def _sweep(self) -> None:
        """Drop transfer requests whose prefill never came within the deadline; fail exactly
        the requests of decode peers that went silent (no heartbeat for dead_after_s)."""
        now = time.monotonic()
        with self._lock:
            dead = {i for i, p in self._peers.items() if now - p.last_seen > self.config.dead_after_s}
            for identity in dead:
                log.warning("decode %s silent for %.0f s: dropping it", self._peers[identity].target.session_id,
                            self.config.dead_after_s)
                self._peers.pop(identity).workers.shutdown(wait=False)
            lost = [r for r in self._requests.values() if r.peer in dead]
        for r in lost:
            r.state.fail("decode peer silent")
        with self._lock:
            stale = [r for r in self._requests.values()
                     if r.tokens is None and now - r.created > self.config.request_timeout_s]
            for r in stale:
                del self._requests[r.room]
        for r in stale:
            r.state.fail("prefill never arrived")
            if r.peer is not None:
                self._outbox.put(r.peer, encoder.encode(TransferDone(r.room, self.epoch, False, r.state.reason)))

    def available(self) -> dict[str, int]:
        return self.pool.available()

    def close(self) -> None:
        self._stop.set()
        self._io.join()
        for peer in self._peers.values():
            peer.workers.shutdown(wait=True)
        if self.bootstrap is not None:
            self.bootstrap.stop()
        self.sender.close()
        self._outbox.close()
        self._router.close(linger=0)
        self._ctx.term()
