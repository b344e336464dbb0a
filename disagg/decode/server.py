"""DecodeServer: a decode worker's request path and its loop.

    HTTP /decode (room, tokens) -> bootstrap lookup of the prefill ranks holding our heads
        -> register once per prefill peer -> admit: alloc (SWA window only)
        -> staging slots and a TransferRequest per sender -> TransferStarted -> ...
        -> every sender's TransferDone -> verify every byte (model engine) -> decode N

Who does what:
- the HTTP thread of a request looks prefill up, admits, sends the TransferRequest, waits,
  verifies and decodes;
- the loop thread owns the control sockets (one DEALER per prefill, disagg.control.io): it
  pulls messages, hands staged chunks to the scatter workers and acks them once scattered
  (decode/chunks.py), beats every prefill and drops silent ones, and sweeps the quarantine;
- every phase change of a request goes through the RequestTable (decode/requests.py), which
  keeps a failed request's pages until prefill confirms it stopped writing.
"""

import logging
import random
import threading
import time
from dataclasses import dataclass

import numpy as np

from disagg.control import digests
from disagg.control.io import DealerIO
from disagg.control.messages import (
    PROTOCOL_VERSION,
    ChunkLanded,
    Heartbeat,
    RegisterDecode,
    Registered,
    Refused,
    TransferDone,
    TransferRequest,
    TransferStarted,
    indices_to_wire,
)
from disagg.decode.chunks import StagedChunks
from disagg.decode.introducer import Introducer, ReadinessWatch
from disagg.decode.peers import PrefillPeers
from disagg.decode.release import Release
from disagg.decode.instances import SenderRanks
from disagg.decode.requests import DecodeRequest, Phase, RequestTable, Sender
from disagg.engine.base import ModelEngine
from disagg.errors import BadRequest, Cancelled, DisaggError, Overloaded, ProtocolError, VerifyError
from disagg.worker.base import Worker, WorkerSettings
from disagg.worker.flip import flip_unread
from kvpool import KVPoolError
from kvpool import digest as kvdigest
from kvpool.cache.prefix import PrefixCache, reused_bytes
from transfer.receiver import KVReceiver
from transfer.report import TransferReport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig(WorkerSettings):
    bootstrap_addr: str = "tcp://127.0.0.1:8998"  # the default bootstrap (also named "default")
    bootstraps: tuple[tuple[str, str], ...] = ()  # (name, endpoint): the others a request may name
    slots_per_transfer: int = 2
    # A failed request whose TransferRequest went out keeps its pages until that prefill says
    # TransferDone (it stopped writing), or at the latest this long: beyond Mooncake's own
    # 30 s retention of in-flight slices.
    quarantine_s: float = 60.0
    heartbeat_interval_s: float = 1.0  # to every registered prefill
    check_rate: float = 0.0  # share of requests compared with a colocated run (engine.check)
    prefix_cache: bool = True  # keep finished requests' pages and reuse them as prefixes (kvpool.cache)
    scatter_workers: int = 4  # threads scattering staged chunks (decode/chunks.py), off the loop thread


class DecodeServer(Worker):
    def __init__(self, config: DecodeConfig, model: ModelEngine | None = None):
        super().__init__(config, model, swa_window_only=True)
        self.config = config
        self.receiver = KVReceiver(self.endpoint)
        self.io = DealerIO(self.gate)
        self.cache = PrefixCache(self.pool) if config.prefix_cache and self.model.exact_reuse else None
        if config.prefix_cache:  # where reuse is not exact, say so loudly (the engine's words)
            (log.info if self.model.exact_reuse else log.warning)(
                "prefix cache %s: %s", "on" if self.model.exact_reuse else "off", self.model.reuse_note
            )
        self.requests = RequestTable(
            config.deadlines,
            config.quarantine_s,
            Release(self.pool, self.receiver, self.admission, self.cache),
            self.io.send,
            self.endpoint.unsettled,
        )
        self.chunks = StagedChunks(self.requests, self.receiver, self.io.reply, self.io.wake, config.scatter_workers)
        self.peers = PrefillPeers(self.gate, self.layout, config.dead_after_s)
        self.instances = SenderRanks(self.receiver)
        self.introducer = Introducer(self.peers, self.instances, self.io, self._registration)
        self.watch = ReadinessWatch(self.introducer, config.bootstrap_addr, config.deadlines.bootstrap_s)
        self._loop_thread = threading.Thread(target=self._loop, name="decode-loop", daemon=True)
        self._loop_thread.start()
        self.ready = True
        self.watch.start()

    def _registration(self) -> RegisterDecode:
        pc = self.pool.config
        return RegisterDecode(
            PROTOCOL_VERSION,
            self.epoch,
            self.layout,
            self.endpoint.offers(),
            self.endpoint.staging_info(),
            tp_size=pc.tp_size,
            tp_rank=pc.tp_rank,
        )

    # ---- the request path (HTTP threads) -----------------------------------------------------
    def _admit(self, r: DecodeRequest, tokens: np.ndarray, max_new_tokens: int, deadline: float) -> None:
        """Reserve what the request holds by its last token (the prompt and max_new_tokens - 1
        more: the last one's KV is never written; SWA: the window's worth), so a generation never
        runs out of pages midway: 400 if it could never fit, 503 if the pool stays full. With
        the prefix cache, on the longest cached prefix (only the rest allocated; cached pages
        nobody uses are evicted before a request waits)."""
        num_tokens = len(tokens)
        grow_to = num_tokens + max_new_tokens - 1

        def alloc():
            if self.faults.hit("decode.alloc"):
                raise KVPoolError("injected fault at decode.alloc")
            if self.cache is not None:
                return self.cache.admit(tokens, grow_to)
            return self.pool.alloc_request(num_tokens, swa_window_only=True, grow_to=grow_to), None

        kv, hit = self.admission.admit(num_tokens, alloc, deadline, grow_to)
        self.requests.admitted(r, kv, self.pool.index_set(kv), hit=hit)
        self.load.admitted(r)

    def decode(self, room: int, token_ids: np.ndarray, max_new_tokens: int = 1, bootstrap: str | None = None) -> dict:
        """Receive the prompt's KV from prefill, verify it, decode. Returns the outcome with
        timings; raises Overloaded (pool full past queue_wait_s) or TooLarge after cleanup."""
        tokens = self.check_tokens(token_ids)  # BadRequest before anything changes
        bootstrap_endpoint = self.bootstrap_endpoint(bootstrap)
        try:
            r = self.requests.open(room)
        except ProtocolError as exc:  # refused; the request with this room goes on
            return {"room": room, "state": "FAILED", "verified": False, "reason": f"ProtocolError: {exc}"}
        with self.load.held(r, len(tokens)):  # (/health's load: queued, running once admitted)
            return self._serve(r, tokens, max_new_tokens, bootstrap_endpoint)

    def _serve(self, r: DecodeRequest, tokens: np.ndarray, max_new_tokens: int, bootstrap_endpoint: str) -> dict:
        """decode() of a request whose room is open: its answer; the room is finished (freed,
        or quarantined while prefill may write) when this returns or raises."""
        room, timings = r.room, {}
        try:
            if r.phase.ended:  # aborted before it got here
                return {"room": room, "state": "FAILED", "verified": False, "reason": r.reason}
            peers = self._receive(r, tokens, max_new_tokens, bootstrap_endpoint, timings)
            if r.phase is not Phase.SUCCESS:
                return {"room": room, "state": "FAILED", "verified": False, "reason": r.reason, **timings}
            return {
                **self._generate(r, tokens, max_new_tokens, timings),
                "transport": "+".join(sorted({p.transport for p in peers})),
            }
        except Cancelled:  # aborted while generating: stopped at a step, freed below
            return {"room": room, "state": "FAILED", "verified": False, "reason": r.reason, **timings}
        except VerifyError as exc:
            return {
                "room": room,
                "state": "FAILED",
                "verified": False,
                "integrity": "verify",
                "reason": f"verify: {exc}",
                **timings,
            }
        except (DisaggError, KVPoolError) as exc:
            self.requests.fail(r, f"{type(exc).__name__}: {exc}")
            if isinstance(exc, (Overloaded, ValueError)):
                raise  # HTTP 503 / 400, after the cleanup below
            return {
                "room": room,
                "state": "FAILED",
                "verified": False,
                "reason": f"{type(exc).__name__}: {exc}",
                **timings,
            }
        finally:
            self.requests.finish(r)

    def _receive(
        self, r: DecodeRequest, tokens: np.ndarray, max_new_tokens: int, bootstrap_endpoint: str, timings: dict
    ) -> list:
        """Find the prefill ranks, admit the request, lend staging slots, ask every sender for
        its share and wait until the table ends the transfer (r.phase says how). Returns the
        sender ranks' peers."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.config.deadlines.bootstrap_s
        peers = self.introducer.senders(bootstrap_endpoint, deadline)
        timings["bootstrap_ms"] = (time.perf_counter() - t0) * 1e3
        self._admit(r, tokens, max_new_tokens, deadline)
        lanes = [self.instances.lanes(p.info) for p in peers]  # (may refuse: before any slot is leased)
        slots = self._lend(peers, lanes, len(tokens), r.prefix_len, deadline)
        t1 = time.perf_counter()
        senders = [Sender(p.endpoint, p.epoch, s, lanes=l) for p, s, l in zip(peers, slots, lanes)]
        if self.requests.sending(r, senders):  # an abort may have come meanwhile
            indices = indices_to_wire(r.dst)
            for s in senders:
                self.io.send(
                    s.endpoint,
                    TransferRequest(r.room, self.epoch, len(tokens), indices, s.slots, prefix_len=r.prefix_len),
                )
            self.requests.wait(r)
        timings["wait_ms"] = (time.perf_counter() - t1) * 1e3
        return peers

    def _generate(self, r: DecodeRequest, tokens: np.ndarray, max_new_tokens: int, timings: dict) -> dict:
        """Verify the KV that arrived, decode, check against a colocated run where asked, and
        keep the request's pages in the prefix cache when nothing failed. Returns the answer."""
        if self.faults.hit("decode.flip"):
            log.warning(
                "room %d: injected fault at decode.flip: %s", r.room, flip_unread(self.pool, r.kv, r.prefix_len)
            )
        t2 = time.perf_counter()
        held = self._verify(r, tokens, r.room)
        timings["verify_ms"] = (time.perf_counter() - t2) * 1e3
        t3 = time.perf_counter()
        output = self.model.decode(self.pool, r.kv, tokens, max_new_tokens, stop=lambda: self.requests.stopped(r))
        timings["decode_ms"] = (time.perf_counter() - t3) * 1e3
        timings.update({f"{k}_ms": v for k, v in output.timings_ms.items()})  # e.g. rebuild_ms, steps_ms
        checked = self._check(r.room, tokens, output, timings)
        if "integrity" not in checked:
            self._keep(r, tokens, output.tokens)
        return {
            "room": r.room,
            "state": "SUCCESS",
            "verified": True,
            "digests": held,
            "output_tokens": output.tokens,
            **self._report(r),
            "kv_ready_at": r.kv_ready_at,
            **timings,
            **checked,
        }

    def _verify(self, r: DecodeRequest, tokens: np.ndarray, room: int) -> dict[str, str]:
        """What arrived is this prompt's (the engine: the AUX row; the stand-in every byte) and
        every unit this rank holds is the bytes its sender wrote (the senders' digests, for an
        engine with `byte_digest`); VerifyError naming the first that is not, ProtocolError
        for a malformed digest. Returns a short digest per component (the answer's `digests`;
        {} without)."""
        self.model.verify(self.pool, r.kv, tokens, room)
        if not self.model.byte_digest:  # (its verify checked every byte)
            return {}
        cfg = self.pool.config
        tp = (cfg.tp_size, cfg.tp_rank)
        want = digests.expected(cfg.model, tp, [s.done.digest for s in r.senders.values() if s.done is not None])
        held = kvdigest.compute(self.pool, r.kv, len(tokens))
        digests.check(cfg.model, tp, held, want)
        return digests.summary(held)

    def _check(self, room: int, tokens: np.ndarray, output, timings: dict) -> dict:
        """The keys a colocated check adds to the answer (--check-rate: on that share of the
        requests; else none). A check that differs fails the request (integrity "check":
        HTTP 500 at the router): an answer known to be wrong is never passed off as a good one."""
        if not (self.config.check_rate and random.random() < self.config.check_rate):
            return {}
        t = time.perf_counter()
        check = self.model.check(tokens, output)
        timings["check_ms"] = (time.perf_counter() - t) * 1e3
        if check["token_match"] and check.get("logits_match", True) and check.get("shard_match", True):
            return {"check": check}
        log.warning("room %d: generation differs from the colocated run: %s", room, check)
        differs = (
            f"tokens differ from index {check['first_mismatch']}"
            if not check["token_match"]
            else f"logits differ (max {check.get('max_logit_diff', float('nan')):.3g}), tokens equal"
            if not check.get("logits_match", True)
            else f"the bytes this rank holds differ from its shard: {check.get('shard_differences')}"
        )
        return {
            "check": check,
            "state": "FAILED",
            "integrity": "check",
            "reason": f"check: the generation differs from the colocated run: {differs}",
        }

    def _keep(self, r: DecodeRequest, prompt: np.ndarray, output: list[int]) -> None:
        """A request that verified and generated: the cache may keep its KV when it is freed,
        keyed by the ids of the positions it holds (the prompt, then every generated token but
        the last, whose KV is never written) as far as the engine says a later prompt's
        prefill would compute the same bits there (ModelEngine.reusable)."""
        if r.hit is not None:
            held = np.concatenate([prompt, np.asarray(output[: r.kv.num_tokens - len(prompt)], dtype=np.int64)])
            self.requests.generated(r, held[: self.model.reusable(len(prompt), len(held))])

    def _report(self, r: DecodeRequest) -> dict:
        """What the senders reported of a request that arrived, merged, as the answer carries it
        (every key, even if a sender reported nothing), and what it reused of the prefix cache
        (prefix_tokens; reused_bytes: what it did not receive thanks to them)."""
        report = self.requests.report(r) or TransferReport(sends=0)
        reused = reused_bytes(self.pool, r.kv.num_tokens, r.prefix_len) if r.prefix_len else 0
        return {**report.to_dict(), "senders": len(r.senders), "prefix_tokens": r.prefix_len, "reused_bytes": reused}

    def _lend(self, peers: list, lanes: list, num_tokens: int, prefix_len: int, deadline: float) -> list[list[int]]:
        """Every sender's staging slots, all at once (KVReceiver.lend), for what moves (the
        suffix after prefix_len). Senders that move by token would go direct without one (a
        range per row slice): for them the request waits for slots, like for pool space,
        until the bootstrap deadline. A sender that said it never stages (Registered.may_stage:
        its mode, or it gathers, TP 1 -> 8) wants none, so slots it would hand back unused
        never cap how many requests run, nor make one wait."""
        most = self.config.slots_per_transfer
        wants = [
            self.receiver.slots_wanted(l, num_tokens, most, prefix_len) if p.may_stage else 0
            for p, l in zip(peers, lanes)
        ]
        by_token = any(l is not None and w for l, w in zip(lanes, wants))
        return self.receiver.lend(wants, max(0.0, deadline - time.monotonic()) if by_token else 0.0)

    def quarantined(self) -> int:
        return self.requests.quarantined()

    def bootstrap_endpoint(self, name: str | None) -> str:
        """The endpoint of a configured bootstrap, by name or by its endpoint; None: the default.
        Never an address a request makes up: decode sends its registration (session, regions)
        only to prefills that a bootstrap it was configured with names."""
        known = {"default": self.config.bootstrap_addr, **dict(self.config.bootstraps)}
        if name is None:
            return self.config.bootstrap_addr
        if name in known:
            return known[name]
        if name in known.values():
            return name
        raise BadRequest(
            f"bootstrap {name[:100]!r} is not one this decode is configured with (--bootstrap-addr); "
            f"known names: {', '.join(sorted(known))}"
        )

    def health(self) -> dict:
        """/health, with the bootstraps a request may name (the router checks its pairs'
        against them)."""
        known = {"default": self.config.bootstrap_addr, **dict(self.config.bootstraps)}
        cache = {"prefix_cache": self.cache.stats()} if self.cache is not None else {}
        return {**super().health(), "bootstraps": sorted({*known, *known.values()}), **cache}

    def available(self) -> dict[str, int]:
        """What a new request can take of the pool: its free capacity, and the cached pages
        nobody uses (evicted for it)."""
        return self.cache.available() if self.cache is not None else self.pool.available()

    def readiness(self) -> dict:
        """/ready, at once: the pool is registered and this decode is registered with the
        prefill behind its default bootstrap (ReadinessWatch keeps it so); when not, why (what
        a person fixes: the address, the key, prefill not up yet, a different model)."""
        if not self.ready:
            return {"ready": False, "why": "starting: pool and transports not registered yet"}
        return self.watch.state()

    # ---- the loop thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        next_sweep = time.monotonic() + 1.0
        next_beat = time.monotonic() + self.config.heartbeat_interval_s
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_sweep:
                try:
                    for r in self.requests.sweep():
                        log.warning(
                            "room %d: released from quarantine after %.0f s without word from prefill",
                            r.room,
                            self.config.quarantine_s,
                        )
                except Exception:
                    log.exception("quarantine sweep failed")
                next_sweep = now + 1.0
            if now >= next_beat:
                for endpoint in self.peers.silent():
                    self._peer_lost(endpoint, f"prefill {endpoint} silent for {self.config.dead_after_s:.0f} s")
                for endpoint in self.peers.abandoned():  # its registration failed
                    self.io.drop(endpoint)
                for endpoint in self.peers.registered_endpoints():
                    self.io.reply(endpoint, Heartbeat(self.epoch))
                next_beat = now + self.config.heartbeat_interval_s
            for endpoint, msg in self.io.recv(100):
                try:
                    reply = self._handle(endpoint, msg)
                except Exception:  # a bug or a hostile frame must not stop the control plane
                    log.exception("frame from %s failed", endpoint)
                    reply = None
                if reply is not None:
                    self.io.reply(endpoint, reply)
            self.chunks.drain()

    def _peer_lost(self, endpoint: str, reason: str) -> None:
        """Fail exactly the requests with this prefill (their pages stay quarantined until the
        cap: a frozen peer may resume) and close its socket; the next request looks it up and
        registers again (a restarted prefill has a new epoch and maybe a new address)."""
        self.peers.lost(endpoint)
        log.warning("%s: failing %d request(s)", reason, self.requests.peer_lost(endpoint, reason))
        self.io.drop(endpoint)

    def _handle(self, endpoint: str, msg):
        """One message from a prefill -> the reply to send back, if any."""
        if isinstance(msg, ProtocolError):
            log.warning("frame from %s refused: %s", endpoint, msg)
            return None
        self.peers.heard(endpoint)
        match msg:
            case Registered(epoch=epoch, transport=transport, may_stage=may_stage):
                self.peers.registered(endpoint, epoch, transport, may_stage)
            case Refused(reason=reason):
                if self.peers.refused(endpoint, reason):  # it dropped us after we registered
                    self._peer_lost(endpoint, f"prefill {endpoint} dropped us: {reason}")
            case TransferStarted(room=room, prefill_epoch=epoch):
                self.requests.started(room, endpoint, epoch)
            case ChunkLanded():
                self.chunks.landed(endpoint, msg)  # scattered on a worker; ChunkDone once it is
            case TransferDone():
                self.requests.done(msg, endpoint)
        return None

    def threads(self) -> dict[str, bool]:
        """For /health: whether each thread this process cannot serve without is alive."""
        return {**super().threads(), "loop": self._loop_thread.is_alive(), "ready-watch": self.watch.alive()}

    def close(self) -> None:
        self.watch.stop()
        self._stop.set()
        self._loop_thread.join()
        self.chunks.close()
        self.io.close()
        super().close()
