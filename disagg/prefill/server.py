"""PrefillServer: the prefill side of the control plane (request path; the control socket is
in prefill_control).

    HTTP /prefill (room, tokens) --> admit + engine.prefill --+
                                                              +--> transfer worker --> TransferDone
    control ROUTER <-- TransferRequest (room, dst indices) ---+        (KVSender.send, AUX last)

Transfers run on worker pools sharded by destination: each decode peer has its own
`transfer_workers` threads, so a slow or dead peer stalls only its own shard. A transfer
starts once both the local KV and the decode's destination indices are there, in either
order. However a request ends, its slots are free before anyone hears the outcome, and the
decode side hears it: TransferDone(fail) when decode is known, else a tombstone answers its
late TransferRequest at once.
"""

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import zmq

from disagg.control.admission import Admission, empty_pool_fit
from disagg.bootstrap.server import BootstrapClient, BootstrapConfig, BootstrapServer
from disagg.control.phases import Deadlines, KVPoll, TransferState
from disagg.control.outbox import Outbox
from disagg.worker.pool_settings import PoolSettings
from disagg.prefill.control import PrefillControl, PrefillRequest
from disagg.control.messages import (PROTOCOL_VERSION, Decoder, LayoutInfo, RegisterPrefill, ToPrefill, TransferDone,
                                     TransferStarted, encoder)
from disagg.engine.standin import EnginePlugin, StandInEngine
from disagg.control.tombstones import Tombstones
from kvpool import HybridPool, KVPoolError
from transfer.config import TransferConfig
from transfer.transports import TransportSettings, create
from disagg.errors import DisaggError, Overloaded, ProtocolError
from transfer.sender import KVSender

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillConfig:
    pool: PoolSettings = PoolSettings()
    host: str = "127.0.0.1"                 # bound and advertised (control socket)
    transports: tuple[str, ...] = ("mooncake",)   # what this side can write with
    transport_settings: TransportSettings = TransportSettings()
    control_port: int = 0                   # 0: any free port
    bootstrap_bind: str | None = "tcp://127.0.0.1:8998"   # run the bootstrap here (None: external)
    bootstrap_addr: str | None = None       # where to register (default: our own bootstrap)
    tp_rank: int = 0
    tp_size: int = 1
    transfer_workers: int = 4               # per decode peer
    transfer: TransferConfig = field(default_factory=TransferConfig)
    deadlines: Deadlines = field(default_factory=Deadlines)
    dead_after_s: float = 5.0               # decode silence (no heartbeat) that fails its requests
    queue_wait_s: float = 5.0               # longest wait for pool space before refusing
    max_waiting: int = 64                   # requests waiting for pool space; more are refused at once


class PrefillServer(PrefillControl):
    def __init__(self, config: PrefillConfig, plugin: EnginePlugin | None = None):
        self.config = config
        self.plugin = plugin or StandInEngine()
        self.pool = HybridPool(config.pool.pool_config())
        self.admission = Admission(empty_pool_fit(self.pool, False), config.max_waiting, config.queue_wait_s)
        self.sender = KVSender(create(config.transports, config.transport_settings), self.pool, config.transfer)
        self.faults = self.sender.faults
        self.epoch = time.time_ns()
        self.layout = LayoutInfo(self.pool.page_size, self.pool.config.layout.value, self.sender.buffers)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        port = config.control_port or self._router.bind_to_random_port(f"tcp://{config.host}")
        if config.control_port:
            self._router.bind(f"tcp://{config.host}:{port}")
        self.control_endpoint = f"tcp://{config.host}:{port}"
        self._outbox = Outbox(self._ctx)
        self._decoder = Decoder(ToPrefill, "prefill control")
        self._lock = threading.Lock()
        self._requests: dict[int, PrefillRequest] = {}
        self._ended = Tombstones(ttl_s=config.deadlines.bootstrap_s + config.deadlines.waiting_s)
        self._peers = {}
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
                                            self.epoch, self.layout))
        finally:
            client.close()
        self.ready = True

    # ---- the request path (HTTP handler threads) --------------------------------------------
    def prefill(self, room: int, token_ids: np.ndarray) -> dict:
        """Compute the prompt's KV, wait for decode's destination, transfer. Returns the outcome
        with timings; the request's pool slots are free again when this returns. Raises
        Overloaded (pool full past queue_wait_s) or TooLarge after the same cleanup."""
        t0 = time.perf_counter()
        tokens = np.asarray(token_ids, dtype=np.int64)
        with self._lock:
            r = self._requests.get(room)
            if r is not None and r.tokens is not None:
                raise ProtocolError(f"duplicate room {room}")
            if r is None:
                r = self._requests[room] = PrefillRequest(room, TransferState(room))
            r.tokens = tokens
            ended = self._ended.reason(room)
        if ended:  # aborted before it got here
            r.state.fail(ended)
        refused = None
        req = None
        try:
            if not r.state.poll().terminal:
                deadline = time.monotonic() + self.config.deadlines.waiting_s
                req = self.admission.admit(len(tokens), lambda: self.pool.alloc_request(len(tokens)), deadline)
                self.faults.check("prefill.compute")
                self.plugin.prefill(self.pool, req, tokens, room)
                r.timings["prefill_ms"] = (time.perf_counter() - t0) * 1e3
                r.timings["prefill_done_at"] = time.time()  # wall clock: the router measures hand-off with it
                with self._lock:  # only now may a transfer see it: never ship half-computed KV
                    r.req, req = req, None
                self._maybe_submit(r)
        except (KVPoolError, DisaggError) as exc:
            if isinstance(exc, (Overloaded, ValueError)):
                refused = exc
            r.state.fail(f"prefill: {type(exc).__name__}: {exc}")
        finally:
            if req is not None:  # allocated but never handed over
                self.pool.free_request(req)
                self.admission.released()
        r.state.wait_phased(self.config.deadlines, "prefill")
        self._end(r)
        if refused is not None:
            raise refused
        return {"room": room, "state": r.state.poll().name, "reason": r.state.reason, **r.timings, **r.report}

    def _end(self, r: PrefillRequest) -> None:
        """Forget a finished request; free it unless its transfer worker will; make sure decode
        hears a failure (now, or through a tombstone when its TransferRequest comes later)."""
        with self._lock:
            if r.submitted:
                return  # the worker frees, forgets and reports once it stopped writing
            if self._requests.get(r.room) is r:
                del self._requests[r.room]
            self._free(r)
            if r.state.poll() is not KVPoll.FAILED:
                return
            if r.peer is None:
                self._ended.bury(r.room, r.state.reason)
                return
            if r.told:
                return
            r.told = True
        self._outbox.put(r.peer, encoder.encode(TransferDone(r.room, self.epoch, False, r.state.reason)))

    def _fail_now(self, r: PrefillRequest, why: str) -> bytes | None:
        """Fail `r`. If no transfer runs for it (and none will: it is terminal now), returns the
        decode to tell at once with TransferDone(fail); its pages are safe to free there."""
        with self._lock:
            r.state.fail(why)
            if r.submitted or r.told or r.peer is None:
                return None
            r.told = True
            return r.peer

    def abort(self, room: int, reason: str) -> dict:
        """Abort a room (router, client or operator). Decode hears it at once, a running
        transfer stops before its next write, the slots come back. An unknown room is
        remembered as aborted."""
        why = f"aborted: {reason}"
        with self._lock:
            r = self._requests.get(room)
            if r is None:
                self._ended.bury(room, why)
                return {"room": room, "aborted": False, "known": False}
        ended = r.state.poll() is not KVPoll.FAILED
        tell = self._fail_now(r, why)
        if tell is not None:
            self._outbox.put(tell, encoder.encode(TransferDone(room, self.epoch, False, r.state.reason)))
        if r.tokens is None:  # only decode's TransferRequest was here: no prefill thread will end it
            self._ended.bury(room, why)
            self._end(r)
        return {"room": room, "aborted": ended and r.state.poll() is KVPoll.FAILED, "known": True}

    def _maybe_submit(self, r: PrefillRequest) -> None:
        with self._lock:
            if r.req is None or r.dst is None or r.submitted or r.state.poll().terminal:
                return
            peer = self._peers.get(r.peer)
            if peer is None:
                return
            try:  # under the lock: the sweep cannot shut the shard down in between
                peer.workers.submit(self._transfer, r)
            except RuntimeError as exc:  # shut down (closing) or no thread to be had
                r.state.fail(f"transfer workers unavailable: {exc}")
                return
            r.submitted = True

    def _transfer(self, r: PrefillRequest) -> None:
        """Send, free the request's slots, then end its state and tell decode: once anyone sees
        the outcome, the slots are already back."""
        peer = self._peers.get(r.peer)
        ok, reason, report = False, "", None
        try:
            if peer is None:
                raise ProtocolError("decode peer is not registered")
            r.state.advance(KVPoll.TRANSFERRING)
            self._outbox.put(r.peer, encoder.encode(TransferStarted(r.room, self.epoch)))
            t0 = time.perf_counter()
            report = self.sender.send(peer.target, self.pool.index_set(r.req), r.dst, r.room, r.slots, peer.relay,
                                      stopped=lambda: r.state.poll().terminal)
            r.report = {"bytes": report.nbytes, "mode": report.mode.value, "ranges": report.ranges,
                        "transfer_ms": (time.perf_counter() - t0) * 1e3}
            ok = True
        except (DisaggError, KVPoolError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("room %d: transfer failed: %s", r.room, exc)
        finally:
            with self._lock:  # writes are over: only now may an Abort for the room be answered at once
                try:
                    self._free(r)
                finally:
                    if self._requests.get(r.room) is r:
                        del self._requests[r.room]
            if ok:
                try:
                    r.state.complete(r.room)
                except ProtocolError:  # a deadline or an abort ended it meanwhile
                    ok, reason = False, r.state.reason
            else:
                r.state.fail(reason or "transfer failed")
                reason = r.state.reason
            done = TransferDone(r.room, self.epoch, False, reason)
            if ok:
                done = TransferDone(r.room, self.epoch, True, "", report.nbytes, report.mode.value, report.ranges,
                                    r.report["transfer_ms"])
            if r.peer is not None and not self.faults.hit("control.drop_done"):
                self._outbox.put(r.peer, encoder.encode(done))

    def _free(self, r: PrefillRequest) -> None:
        """(Under self._lock.)"""
        if r.req is not None and not r.freed:
            self.pool.free_request(r.req)
            r.freed = True
            self.admission.released()

    def available(self) -> dict[str, int]:
        return self.pool.available()

    def close(self) -> None:
        self._stop.set()
        self._io.join()
        for peer in self._peers.values():
            peer.workers.shutdown(wait=True)
            peer.target.link.close()
        if self.bootstrap is not None:
            self.bootstrap.stop()
        self.sender.close()
        for t in self.sender.transports:
            t.close()
        self._outbox.close()
        self._router.close(linger=0)
        self._ctx.term()
