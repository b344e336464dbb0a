"""PrefillServer: a prefill worker's request path and its loop.

    HTTP /prefill (room, tokens) --> admit + model engine computes KV --+
                                                                        +--> transfer worker
    control ROUTER <-- TransferRequest (room, dst indices) ------------+     (KVSender.send, AUX
                                                                              last) --> TransferDone

Who does what:
- the HTTP thread of a request admits it, runs the model engine and waits for the end;
- the loop thread owns the control socket (disagg.control.io) and the decode peers: it
  pulls messages, registers peers, sweeps silent ones;
- a transfer worker (one shard of threads per decode peer) prepares and sends
  (prefill/jobs.py);
- every state change of a request goes through the RequestTable (prefill/requests.py), whose
  effects (free, tell decode, prepare, send) are its TransferJobs' (prefill/jobs.py): built
  here with their collaborators and given to the table once; neither calls the server.
"""

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
import time
from dataclasses import dataclass

import numpy as np

from disagg.api.fields import STREAM_LAYERS
from disagg.bootstrap.lease import BootstrapLease
from disagg.bootstrap.server import BootstrapConfig, BootstrapServer
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
    indices_from_wire,
)
from disagg.control.io import RouterIO
from disagg.engine.base import ModelEngine
from disagg.errors import BadRequest, DisaggError, Overloaded, ProtocolError
from disagg.prefill.peers import DecodePeers
from disagg.prefill.jobs import TransferJobs
from disagg.prefill.requests import Phase, PrefillRequest, RequestTable
from disagg.worker.base import Worker, WorkerSettings
from disagg.worker.flip import flip_byte
from kvpool import KVPoolError, RequestKV
from kvpool.cache.prefix import Hit, PrefixCache
from kvpool import digest as kvdigest
from kvpool.errors import SpecError
from transfer.errors import BadPrefix, TransferError
from transfer.progress import LayerProgress
from transfer.sender import KVSender
from transfer.suffix import check_prefix

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillConfig(WorkerSettings):
    control_port: int = 0  # 0: any free port
    bootstrap_bind: str | None = "tcp://127.0.0.1:8998"  # run the bootstrap here (None: external)
    bootstrap_addr: str | None = None  # where to register (default: our own bootstrap)
    transfer_workers: int = 4  # per decode peer
    stream_layers: str = "auto"  # on | off | auto: send layer groups while computing
    stream_min_tokens: int = 2048  # auto streams prompts at least this long
    prefix_cache: bool = True  # keep computed prompts' pages and skip computing a cached prefix (kvpool.cache)

    def __post_init__(self) -> None:
        if self.stream_layers not in STREAM_LAYERS:
            raise ValueError(f"stream_layers must be one of {', '.join(STREAM_LAYERS)}")


class PrefillServer(Worker):
    def __init__(self, config: PrefillConfig, model: ModelEngine | None = None):
        super().__init__(config, model, swa_window_only=False)
        self.config = config
        self.sender = KVSender(self.endpoint)
        self.io = RouterIO(self.gate, config.host, config.control_port)
        self.control_endpoint = self.io.endpoint
        self.peers = DecodePeers(
            self.sender, self.layout, self.io, config.transfer_workers, config.dead_after_s, self.epoch
        )
        self.cache = self._prefix_cache(config)
        self.requests = RequestTable(
            self.epoch,
            config.deadlines,
            TransferJobs(self.epoch, self.io, self.peers, self.sender, self.admission, self.cache),
        )
        # the KV's digest is computed beside its transfer, not before it: only TransferDone needs it
        self._digests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-digest")
        rank = RegisterPrefill(
            PROTOCOL_VERSION, config.pool.tp_rank, config.pool.tp_size, self.control_endpoint, self.epoch, self.layout
        )
        # (a bootstrap of our own holds our rank from its start: it started with us)
        self.bootstrap = (
            BootstrapServer(
                BootstrapConfig(config.bootstrap_bind), self.gate, own=None if config.bootstrap_addr else rank
            ).start()
            if config.bootstrap_bind
            else None
        )
        self.bootstrap_endpoint = config.bootstrap_addr or (self.bootstrap.endpoint if self.bootstrap else None)
        if self.bootstrap_endpoint is None:
            raise ValueError("give bootstrap_bind or bootstrap_addr")
        self._loop_thread = threading.Thread(target=self._loop, name="prefill-loop", daemon=True)
        self._loop_thread.start()
        self.lease = BootstrapLease(self.gate, self.bootstrap_endpoint, rank)
        try:
            self.lease.acquire()
        except DisaggError:
            self.close()
            raise
        self.ready = True

    def _prefix_cache(self, config: PrefillConfig) -> PrefixCache | None:
        """The prefix cache, where asked for and the engine can resume a prompt after a cached
        prefix with the bits it would compute in one go (ModelEngine.prefill_reuse; the log says
        why not where it cannot)."""
        if not config.prefix_cache:
            return None
        reuse = self.model.prefill_reuse(self.pool)
        (log.info if reuse.align else log.warning)("prefix cache %s: %s", "on" if reuse.align else "off", reuse.note)
        return PrefixCache(self.pool, window_only=False, align=reuse.align) if reuse.align else None

    # ---- the request path (HTTP threads) -----------------------------------------------------
    def prefill(
        self, room: int, token_ids: np.ndarray, stream: str | None = None, decode_tp: int | None = None
    ) -> dict:
        """Compute the prompt's KV, wait for decode's destinations, transfer (`stream`: on, off
        or auto, default --stream-layers: whether layer groups go while the engine computes;
        `decode_tp`: the decode instance's TP size where the router says it, so a rank that
        holds none of any decode rank's share knows not to wait for one: else the first
        TransferRequest says it).
        Returns the outcome with timings; the request's pages are free when this returns.
        Raises Overloaded (pool full past queue_wait_s) or TooLarge after the same cleanup."""
        t0 = time.perf_counter()
        tokens = self.check_tokens(token_ids)  # BadRequest before anything changes
        mode = stream or self.config.stream_layers
        streams = self._streams(mode, len(tokens))
        receivers = self._receivers(decode_tp) if decode_tp else None
        r = self.requests.prompt(room, tokens, stream_auto=mode == "auto", receivers=receivers, tp_size=decode_tp or 0)
        refused, first_token = None, None
        with self.load.held(r, len(tokens)):  # (/health's load: queued, running once admitted)
            try:
                if not r.phase.ended:
                    first_token = self._compute(r, tokens, streams, t0)
            except (KVPoolError, DisaggError) as exc:
                if isinstance(exc, (Overloaded, ValueError)):
                    refused = exc
                self.requests.fail(r, f"prefill: {type(exc).__name__}: {exc}")
            phase = self.requests.wait(r)
        if refused is not None:
            raise refused
        done = phase is Phase.DONE
        # a rank whose KV goes to no decode rank does not gate the hand-off: its compute end is
        # not where the router's kv_ready_after_compute starts (router/phases.py, issue 40)
        timings = {k: v for k, v in r.timings.items() if r.receivers or k != "prefill_done_at"}
        if r.digest is not None and r.digest.done() and r.digest.exception() is None:
            timings["digest_ms"] = r.digest.result()[1]
        return {
            "room": room,
            "state": "SUCCESS" if done else "FAILED",
            "reason": r.reason,
            **({"first_token": first_token} if done else {}),
            **({"prefix_tokens": r.hit.prefix_len if r.hit else 0} if self.cache is not None else {}),
            **timings,
            **self._report(r),
        }

    def _compute(self, r: PrefillRequest, tokens: np.ndarray, streams: bool, t0: float) -> int:
        """Admit r (on its longest cached prefix, with the prefix cache), compute the rest of its
        KV and hand it to the table; returns the first token. Raises what admission or the
        engine raises, after handing the pages to the table (it fails r and frees them)."""
        deadline = time.monotonic() + self.config.deadlines.waiting_s
        kv, r.hit = self.admission.admit(len(tokens), lambda: self._alloc(tokens), deadline)
        self.load.admitted(r)
        cached = r.hit.prefix_len if r.hit is not None else 0
        try:
            self.faults.check("prefill.compute")
            on_layer = None
            if streams:  # the table takes the pages at the engine's first layer (RequestTable.handover)
                on_layer = self.requests.handover(
                    r, kv, LayerProgress(self.pool.config.model.num_layers, self.pool.config.device)
                )
            else:  # the sends are laid out while the engine computes
                self.requests.allocated(r, self.pool.index_set(kv))
            first_token = self.model.prefill(
                self.pool, kv, tokens, r.room, on_layer=on_layer, cached=cached
            ).first_token
            r.timings["prefill_ms"] = (time.perf_counter() - t0) * 1e3
            r.timings["prefill_done_at"] = time.time()  # wall clock: the router measures hand-off with it
            flipped = self.faults.hit("prefill.flip")
            if flipped:  # a wrong computation: only the colocated check catches it (and it is not cached)
                log.warning("room %d: injected fault at prefill.flip: %s", r.room, flip_byte(self.pool, kv, cached))
            if self.model.byte_digest:
                self._digest(r, kv)  # (beside the sends: their TransferDone carries it)
            if r.hit is not None and not flipped:  # what a later prompt's prefill would compute the same
                r.kept = tokens[: self.model.reusable(len(tokens), len(tokens))]
            held, kv = kv, None
            self.requests.computed(r, held)  # only now may a transfer see it whole (AUX row last)
        except (KVPoolError, DisaggError) as exc:  # (its reason, before the finally's)
            self.requests.fail(r, f"prefill: {type(exc).__name__}: {exc}")
            raise
        finally:
            if kv is not None:  # raised after the pages were allocated (the engine, an injected fault):
                # the table fails r and decides who frees them
                self.requests.compute_ended(r, kv, "prefill: the model engine failed")
        return first_token

    def _alloc(self, tokens: np.ndarray) -> tuple[RequestKV, Hit | None]:
        """A request's pages: on its longest cached prefix with the prefix cache (cached pages
        nobody uses are evicted before it waits), else all its own."""
        if self.cache is not None:
            return self.cache.admit(tokens)
        return self.pool.alloc_request(len(tokens)), None

    def _digest(self, r: PrefillRequest, kv) -> None:
        """Start the digest of the KV as the engine wrote it, which decode checks what arrived
        against (disagg.control.digests): on its own thread, beside the sends (the bytes do not
        change once computed; each send's TransferDone waits for it)."""
        r.digest = self._digests.submit(_timed, kvdigest.compute, self.pool, kv, len(r.tokens))

    def _report(self, r: PrefillRequest) -> dict:
        """What its destinations' sends reported, merged, as the answer carries it ({} when
        none has sent: a rank that feeds no decode rank, or a failure before any send)."""
        report = self.requests.report(r)
        return {**report.to_dict(), "destinations": report.sends} if report is not None else {}

    def _receivers(self, decode_tp: int) -> frozenset[int]:
        try:
            return self.peers.receivers(decode_tp)
        except (SpecError, TransferError) as exc:
            raise BadRequest(f"decode_tp {decode_tp}: {exc}") from None

    def _streams(self, mode: str, num_tokens: int) -> bool:
        if mode not in STREAM_LAYERS:
            raise BadRequest(f"stream_layers must be one of {', '.join(STREAM_LAYERS)}, not {mode!r}")
        return mode == "on" or (mode == "auto" and num_tokens >= self.config.stream_min_tokens)

    # ---- the loop thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        next_sweep = time.monotonic() + 1.0
        while not self._stop.is_set():
            for identity, msg in self.io.recv(100):
                try:
                    reply = self._handle(identity, msg)
                except Exception:  # a bug or a hostile frame must not stop the control plane
                    log.exception("control frame from %r failed", identity)
                    reply = None  # (a Refused would make a registered decode drop the connection)
                if reply is not None:
                    self.io.reply(identity, reply)
            if time.monotonic() >= next_sweep:
                try:
                    self.requests.sweep(self.peers.drop_silent())
                except Exception:
                    log.exception("sweep failed")
                next_sweep = time.monotonic() + 1.0

    def _handle(self, identity: bytes, msg):
        """One message from a decode DEALER -> the reply to send back, if any."""
        if isinstance(msg, ProtocolError):
            log.warning("control frame refused: %s", msg)
            return Refused(str(msg))
        known = self.peers.heard(identity)
        match msg:
            case RegisterDecode():
                return self.peers.register(identity, msg)
            case TransferRequest():
                return self._transfer_request(identity, msg)
            case ChunkDone(transfer_id=room, index=index) if known:
                self.peers.get(identity).relay.on_done(room, index)
            case Abort(room=room, reason=why):
                r = self.requests.get(room)
                if r is None:  # nothing of ours writes for this room (unless a write given up on)
                    return TransferDone(
                        room,
                        self.epoch,
                        False,
                        reason=f"aborted by decode: {why}",
                        settled=not self.endpoint.unsettled(),
                    )
                if not self.peers.same_decode(identity, r.peers()):  # ownership: only its decode ends it
                    log.warning("decode %r tried to abort room %d of another decode: ignored", identity, room)
                    return TransferDone(room, self.epoch, False, reason="not a room of yours: nothing done")
                self.requests.fail(r, f"aborted by decode: {why}")  # every destination of r hears it
                # A decode on a connection the room came from hears the end from the table;
                # the same decode on a new connection (it re-registered) is answered here,
                # unless a transfer still writes (then it asks again later).
                if identity not in r.peers() and r.phase is not Phase.STOPPING:
                    return TransferDone(
                        room, self.epoch, False, reason=r.reason, settled=r.settled and not self.endpoint.unsettled()
                    )
            case Heartbeat():
                if not known:  # we dropped it (it went silent): it must register again
                    return Refused("unknown decode: register again")
                return Heartbeat(self.epoch)
        return None

    def _transfer_request(self, identity: bytes, msg: TransferRequest):
        peer, reason = self.peers.get(identity), None
        if peer is None:
            reason = "decode is not registered"
        elif msg.decode_epoch != peer.epoch:
            reason = f"decode epoch {msg.decode_epoch} is not the registered {peer.epoch}"
        if reason is None:
            try:
                dst = indices_from_wire(msg.indices)
                check_prefix(msg.prefix_len, msg.num_tokens, peer.target.page_size or self.pool.config.page_size)
            except (ProtocolError, BadPrefix) as exc:
                reason = str(exc)
        if reason is not None:
            return TransferDone(msg.room, self.epoch, False, reason=reason)
        size, rank = peer.tp
        return self.requests.destination(
            msg.room,
            identity,
            dst,
            list(msg.slots),
            rank,
            size,
            receivers=self.peers.receivers(size),
            prefix_len=msg.prefix_len,
        )

    def available(self) -> dict[str, int]:
        """What a new request can take of the pool: its free capacity, and the cached pages
        nobody uses (evicted for it)."""
        return self.cache.available() if self.cache is not None else self.pool.available()

    def readiness(self) -> dict:
        """/ready: started, and the bootstrap still lists us as our rank's holder (else decode
        is sent to another prefill, and prompts sent here would wait for it in vain)."""
        if not self.ready:
            return {"ready": False, "why": "starting"}
        lost = self.lease.lost
        if lost:
            return {
                "ready": False,
                "why": f"bootstrap {self.bootstrap_endpoint} no longer lists this prefill as "
                f"rank {self.config.pool.tp_rank}: {lost}",
            }
        return {"ready": True, "bootstrap": self.bootstrap_endpoint}

    def health(self) -> dict:
        """/health stays "ok" when the rank is lost (/ready says so): the process is whole, a
        restart cannot take a rank from a live holder, and decode that registered here is
        still served. It shows the lease, for a person looking."""
        hold, why = self.lease.state
        cache = {"prefix_cache": self.cache.stats()} if self.cache is not None else {}
        return {**super().health(), "bootstrap_lease": hold.value + (f": {why}" if why else ""), **cache}

    def threads(self) -> dict[str, bool]:
        """For /health: whether each thread this process cannot serve without is alive."""
        return {
            **super().threads(),
            "loop": self._loop_thread.is_alive(),
            "bootstrap lease": self.lease.alive,
            **({"bootstrap": self.bootstrap.alive} if self.bootstrap is not None else {}),
        }

    def close(self) -> None:
        self.lease.stop()
        self._stop.set()
        self._loop_thread.join()
        self.peers.close()
        self._digests.shutdown(wait=True, cancel_futures=True)
        if self.bootstrap is not None:
            self.bootstrap.stop()
        self.io.close()
        super().close()


def _timed(fn, *args):
    """(fn(*args), its milliseconds)."""
    t = time.perf_counter()
    return fn(*args), (time.perf_counter() - t) * 1e3
