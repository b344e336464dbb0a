"""The prefill's requests: one phase per request, moved only here (under one lock).

A request meets two halves in either order: the prompt (HTTP /prefill) and decode's
destinations (a TransferRequest over the control socket from every decode rank this prefill
rank sends to: one, unless the two instances' TP sizes differ; the first one's TP size says
which ranks to expect). Its pages belong to exactly one holder at a time: the thread
computing its KV, this table, or the transfer workers sending it (one per destination).

    prompt first:     AWAITING_DECODE --last TransferRequest--> COMPUTING --KV ready--> TRANSFERRING
                      (pages allocated: each destination's send is prepared while computing)
    request first:    ORPHANED --------prompt (+ every one)---> COMPUTING        (KV may be ready
                      ORPHANED --prompt, a destination missing--> AWAITING_DECODE  before either)
    streamed:         COMPUTING --pages handed over at the engine's first layer--> STREAMING
                      --KV ready--> TRANSFERRING (a worker sends layer groups as they become
                      final; prefill/handover.py says why not sooner)
    TRANSFERRING --every destination sent--> DONE
    TRANSFERRING, STREAMING --fail (any destination)--> STOPPING --no worker writes--> FAILED
    any other live phase --fail--> FAILED

A streamed request's pages are the table's from `streaming()` on while the engine still
writes them (`computing`): they are freed only once the engine returned and no worker sends.

Each destination hears the end exactly once: TransferDone(ok) as soon as its own send
finished (its KV is complete), TransferDone(fail) on entering FAILED if it has not heard (or,
if it is not known yet, through a tombstone that answers its late TransferRequest). A room's
decode rank is claimed by one connection: another connection's TransferRequest for it, or
one from an instance of another TP size, is refused and changes nothing. Deadlines per phase,
counted from entering it: AWAITING_DECODE bootstrap_s; ORPHANED and COMPUTING waiting_s;
TRANSFERRING transfer_s (prefill/phase.py).
"""

import threading
import time
from collections.abc import Callable

import numpy as np

from disagg.control.messages import TransferDone, TransferStarted
from disagg.control.deadlines import Deadlines, passed as deadline_passed
from disagg.control.tombstones import Tombstones
from disagg.errors import ProtocolError
from disagg.prefill.destinations import Destination
from disagg.prefill.phase import MISSING, Phase, PrefillRequest
from kvpool import IndexSet, RequestKV
from transfer.progress import LayerProgress


class RequestTable:
    """room -> PrefillRequest. Every method is one transition, atomic under the lock; its
    effects (free pages, tell decode, start a transfer) happen inside it."""

    def __init__(self, epoch: int, deadlines: Deadlines, free: Callable[[RequestKV], None],
                 tell: Callable[[bytes, TransferDone | TransferStarted], None],
                 submit: Callable[[PrefillRequest, Destination], str | None],
                 may_stream: Callable[[PrefillRequest], bool] = lambda r: True,
                 prepare: Callable[[PrefillRequest, Destination], None] = lambda r, d: None):
        """may_stream(r): whether a worker may start on r while the engine still computes
        (False: it starts once the KV is computed, as for a request that does not stream).
        prepare(r, d): lay d's send out while r's KV is computed (sets d.prepared)."""
        self.epoch, self.deadlines = epoch, deadlines
        self._free, self._tell, self._submit, self._may_stream = free, tell, submit, may_stream
        self._prepare = prepare
        self._lock = threading.Condition()
        self._rooms: dict[int, PrefillRequest] = {}
        self.ended = Tombstones(ttl_s=deadlines.bootstrap_s + deadlines.waiting_s)

    # ---- arrivals --------------------------------------------------------------------------
    def prompt(self, room: int, tokens: np.ndarray, stream_auto: bool = False, receivers: frozenset[int] | None = None,
               tp_size: int = 0) -> PrefillRequest:
        """The prompt arrived (HTTP). A room that ended here fails at once. `stream_auto`: it
        streams by `auto` (may_stream decides per link). `receivers`: the decode ranks (of an
        instance of `tp_size`) to expect, where the caller knows them (None: the first
        TransferRequest says); none at all: sent once computed."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.tokens is not None:
                raise ProtocolError(f"duplicate room {room}")
            if r is None:
                r = self._rooms[room] = PrefillRequest(room, Phase.AWAITING_DECODE)
            why = self.ended.reason(room)
            if receivers is not None and r.receivers is None:
                r.receivers, r.tp_size = receivers, tp_size
            elif receivers is not None and r.tp_size != tp_size:
                why = why or f"room {room}: the router says decode TP size {tp_size}, decode's request {r.tp_size}"
            if r.phase is Phase.ORPHANED:
                self._move(r, Phase.COMPUTING if r.complete else Phase.AWAITING_DECODE)
            elif r.phase is Phase.AWAITING_DECODE and r.complete:   # no decode rank to wait for
                self._move(r, Phase.COMPUTING)
            r.tokens, r.stream_auto = tokens, stream_auto
            if why and not r.phase.ended:
                self._fail(r, why)
            return r

    def destination(self, room: int, peer: bytes, dst: IndexSet, slots: list[int], rank: int = 0,
                    tp_size: int = 1, receivers: frozenset[int] = frozenset({0})) -> TransferDone | None:
        """Decode rank `rank` (of an instance of `tp_size`, of which we send to `receivers`)
        sent its TransferRequest; returns an answer to send at once, if any."""
        with self._lock:
            r = self._rooms.get(room)
            why = self.ended.reason(room) if r is None else None
            if why is not None:       # this room already ended here: decode must not wait for it
                return TransferDone(room, self.epoch, False, why)
            claimed = r.dests.get(rank) if r is not None else None
            if claimed is not None and claimed.peer == peer:
                return None           # a second TransferRequest: ignored
            refusal = self._refusal(room, r, rank, tp_size, receivers, claimed)
            if refusal:               # nothing changes
                return TransferDone(room, self.epoch, False, refusal)
            if r is None:
                r = self._rooms[room] = PrefillRequest(room, Phase.ORPHANED)
            if r.phase.ended:         # STOPPING: it will not be sent
                return TransferDone(room, self.epoch, False, r.reason)
            r.receivers, r.tp_size = receivers, tp_size
            r.dests[rank] = Destination(peer, rank, dst, list(slots))
            if r.phase is Phase.AWAITING_DECODE and r.complete:
                self._move(r, Phase.COMPUTING)
            self._maybe_start(r)
            self._maybe_prepare(r)
            return None

    @staticmethod
    def _refusal(room: int, r: PrefillRequest | None, rank: int, tp_size: int, receivers: frozenset[int],
                 claimed) -> str | None:
        if claimed is not None:
            return f"decode rank {rank} of room {room} is claimed by another connection"
        if r is not None and r.receivers is not None and r.tp_size != tp_size:
            return f"room {room} goes to a decode instance of TP size {r.tp_size}, not {tp_size}"
        if rank not in receivers:
            return f"this prefill rank holds none of decode rank {rank}'s share of the KV"
        return None

    def allocated(self, r: PrefillRequest, src: IndexSet) -> None:
        """The engine starts computing into pages of indices `src` (the caller keeps them until
        computed()): the sends of the destinations here, and of those that come meanwhile,
        are laid out now, so that they only start writes once the KV is computed."""
        with self._lock:
            if not r.phase.ended:
                r.src = src
                self._maybe_prepare(r)

    def _maybe_prepare(self, r: PrefillRequest) -> None:
        if r.src is None or r.kv is not None or r.phase not in (Phase.AWAITING_DECODE, Phase.COMPUTING):
            return
        for d in r.dests.values():
            if d.prepared is None:
                self._prepare(r, d)

    def streaming(self, r: PrefillRequest, kv: RequestKV, progress: LayerProgress) -> bool:
        """The engine computes into `kv` (its first layer is final, prefill/handover.py),
        reporting to `progress`: the table holds the pages from now on (a worker may send
        layers as they become final, once every destination is here and may_stream agrees).
        False if r already ended: the HTTP thread keeps them, and computed() or
        compute_ended() frees them."""
        with self._lock:
            if r.phase.ended:
                return False
            r.kv, r.progress, r.computing = kv, progress, True
            self._maybe_start(r)
            return True

    def computed(self, r: PrefillRequest, kv: RequestKV) -> None:
        """The KV is computed into `kv`: the table holds it now (and frees it if r ended)."""
        with self._lock:
            if r.computing:    # streamed: the table holds kv already
                r.computing = False
                r.progress.complete()
                if r.phase is Phase.STREAMING:
                    self._move(r, Phase.TRANSFERRING)
                    for d in r.dests.values():
                        self._tell(d.peer, TransferStarted(r.room, self.epoch))
                elif r.phase.ended and r.phase is not Phase.STOPPING:
                    self._release(r)
                else:   # its worker waited for the engine (may_stream), or decode is not here yet
                    self._maybe_start(r)
                return
            if r.phase.ended:
                self._free(kv)
                return
            r.kv = kv
            self._maybe_start(r)

    def compute_ended(self, r: PrefillRequest, kv: RequestKV, why: str) -> None:
        """The engine raised (no computed()) while computing into `kv`: a live r fails with
        `why`; the pages are freed now, or, if the table holds them (streamed), once no worker
        sends them. One decision under the lock: a later streaming() finds r ended."""
        with self._lock:
            held = r.computing and r.kv is kv
            r.computing = False
            if not r.phase.ended:
                self._fail(r, why)
            if not held:
                self._free(kv)
            elif r.phase is not Phase.STOPPING:
                self._release(r)

    def _maybe_start(self, r: PrefillRequest) -> None:
        if (r.phase is Phase.COMPUTING and r.complete and r.kv is not None
                and not (r.computing and not self._may_stream(r))):
            if not r.dests:   # we hold none of the decode instance's share (another rank sends it)
                if not r.computing:
                    self._release(r)
                    self._move(r, Phase.DONE)
                    self._rooms.pop(r.room, None)
                    self._lock.notify_all()
                return
            r.streamed = r.computing
            self._move(r, Phase.STREAMING if r.computing else Phase.TRANSFERRING)
            for d in r.dests.values():
                d.writing = True
                refused = self._submit(r, d)
                if refused:
                    d.writing = False
                    self._fail(r, f"transfer workers unavailable: {refused}")   # the others stop
                    return

    # ---- ends ------------------------------------------------------------------------------
    def finished(self, r: PrefillRequest, ok: bool, reason: str = "", done: TransferDone | None = None,
                 settled: bool = True, dest: Destination | None = None) -> None:
        """The transfer worker of `dest` (None: the only one) stopped writing (sent, failed or
        stopped); `settled` False: it gave up on writes in flight (their peer was lost), which
        may still land."""
        with self._lock:
            d = dest or next(iter(r.dests.values()))
            d.writing, r.settled = False, r.settled and settled
            if ok and r.phase is Phase.TRANSFERRING:
                d.told = True
                self._tell(d.peer, done)   # its KV is complete: it need not wait for the others
                if r.writers or not all(x.told for x in r.dests.values()):
                    return
                self._release(r)
                self._move(r, Phase.DONE)
                if self._rooms.get(r.room) is r:
                    del self._rooms[r.room]
                self._lock.notify_all()
                return
            if r.phase.sending:   # else STOPPING: it keeps the reason it failed for
                self._fail(r, reason or "transfer failed")
            elif r.phase is Phase.STOPPING and not r.writers:
                self._move(r, Phase.FAILED)
                self._end_failed(r)

    def fail(self, r: PrefillRequest, why: str) -> bool:
        """Fail r; returns whether this call ended it."""
        with self._lock:
            if r.phase.ended:
                return False
            self._fail(r, why)
            return True

    def _fail(self, r: PrefillRequest, why: str) -> None:
        r.reason = why
        if r.phase.sending and r.writers:
            self._move(r, Phase.STOPPING)   # the workers stop before their next write, then report
            self._lock.notify_all()
            return
        self._move(r, Phase.FAILED)
        self._end_failed(r)

    def _end_failed(self, r: PrefillRequest) -> None:
        self._release(r)
        if self._rooms.get(r.room) is r:
            del self._rooms[r.room]
        self.ended.bury(r.room, r.reason)   # a late TransferRequest or prompt is answered at once
        for d in r.dests.values():
            if not d.told:
                d.told = True
                self._tell(d.peer, TransferDone(r.room, self.epoch, False, r.reason, settled=r.settled))
        self._lock.notify_all()

    def _release(self, r: PrefillRequest) -> None:
        if r.kv is not None and not r.computing:   # (the engine still writes: computed() frees them)
            kv, r.kv = r.kv, None
            self._free(kv)

    def _move(self, r: PrefillRequest, to: Phase) -> None:
        r.phase, r.since = to, time.monotonic()

    # ---- lookups, waits, sweeps -------------------------------------------------------------
    def get(self, room: int) -> PrefillRequest | None:
        with self._lock:
            return self._rooms.get(room)

    def abort(self, room: int, why: str) -> PrefillRequest | None:
        """Fail a room by number; an unknown room is remembered as ended."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                self.ended.bury(room, why)
                return None
            if not r.phase.ended:
                self._fail(r, why)
            return r

    def wait(self, r: PrefillRequest) -> Phase:
        """Block until r ended, failing it when a phase outlives its deadline."""
        with self._lock:
            while not r.phase.ended:
                limit = r.phase.deadline(self.deadlines)
                left = r.since + limit - time.monotonic()
                if left <= 0:
                    self._fail(r, deadline_passed("prefill", r.phase.name, limit, MISSING[r.phase]))
                    break
                self._lock.wait(left)
            return r.phase

    def sweep(self, lost_peers: set[bytes]) -> None:
        """Fail the requests of decode peers that went silent, and orphans past their deadline."""
        now = time.monotonic()
        with self._lock:
            for r in list(self._rooms.values()):
                if r.phase.ended:
                    continue
                if r.peers() & lost_peers:
                    self._fail(r, "decode peer silent")
                elif r.phase is Phase.ORPHANED and now - r.since > self.deadlines.waiting_s:
                    self._fail(r, "prefill never arrived")
