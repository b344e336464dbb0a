"""The prefill's requests: one phase per request, moved only here (under one lock).

A request meets two halves in either order: the prompt (HTTP /prefill) and decode's
destination (TransferRequest over the control socket). Its pages belong to exactly one
holder at a time: the thread computing its KV, this table, or the transfer worker sending it.

    prompt first:     AWAITING_DECODE --TransferRequest--> COMPUTING --KV ready--> TRANSFERRING
    request first:    ORPHANED --------prompt-----------> COMPUTING             (KV may be ready
                                                                                  before either)
    streamed:         COMPUTING --pages handed over while computing--> STREAMING --KV ready-->
                      TRANSFERRING   (a worker sends layer groups as they become final)
    TRANSFERRING --sent--> DONE
    TRANSFERRING, STREAMING --fail--> STOPPING --worker stopped writing--> FAILED
    any other live phase --fail--> FAILED

A streamed request's pages are the table's from `streaming()` on while the engine still
writes them (`computing`): they are freed only once the engine returned and no worker sends.

Decode hears every end exactly once, from the transition that ends it: TransferDone(ok) from
TRANSFERRING -> DONE, TransferDone(fail) on entering FAILED (or, if decode is not known yet,
through a tombstone that answers its late TransferRequest). Pages are free before anyone
hears the outcome. Deadlines per phase, counted from entering it: AWAITING_DECODE
bootstrap_s; ORPHANED and COMPUTING waiting_s; TRANSFERRING transfer_s.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from disagg.control.messages import TransferDone, TransferStarted
from disagg.control.deadlines import Deadlines, passed as deadline_passed
from disagg.control.tombstones import Tombstones
from disagg.errors import ProtocolError
from kvpool import IndexSet, RequestKV
from transfer.progress import LayerProgress


class Phase(Enum):
    AWAITING_DECODE = "waiting for decode's TransferRequest"
    ORPHANED = "decode's TransferRequest here, the prompt not yet"
    COMPUTING = "KV being computed"
    STREAMING = "KV being computed while a worker sends the layers that are final"
    TRANSFERRING = "a transfer worker is sending"
    STOPPING = "failed while a worker writes; decode hears it when the worker stops"
    DONE = "sent"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        """Over for the caller waiting on it (STOPPING included: it will never succeed)."""
        return self in (Phase.STOPPING, Phase.DONE, Phase.FAILED)

    def deadline(self, d: Deadlines) -> float:
        return {Phase.AWAITING_DECODE: d.bootstrap_s, Phase.TRANSFERRING: d.transfer_s}.get(self, d.waiting_s)

    @property
    def sending(self) -> bool:
        """A transfer worker may be writing."""
        return self in (Phase.STREAMING, Phase.TRANSFERRING)


@dataclass(eq=False)
class PrefillRequest:
    room: int
    phase: Phase
    since: float = field(default_factory=time.monotonic)     # when the phase began
    tokens: np.ndarray | None = None      # the prompt (None while ORPHANED)
    kv: RequestKV | None = None           # the computed KV, once handed to the table
    peer: bytes | None = None             # decode's control identity
    dst: IndexSet | None = None           # decode's destination indices
    slots: list[int] = field(default_factory=list)   # decode staging slots lent to this transfer
    reason: str = ""
    timings: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    progress: LayerProgress | None = None   # streamed: which layers the engine has finished
    computing: bool = False   # streamed: the engine still writes the pages the table holds
    streamed: bool = False    # a worker started while the engine computed
    stream_auto: bool = False # streams by `auto`: only over a link that leaves the compute alone
    settled: bool = True      # False: its writes were abandoned in flight (peer lost): decode is
                              # told so, and keeps the pages until the cap (TransferDone.settled)


class RequestTable:
    """room -> PrefillRequest. Every method is one transition, atomic under the lock; its
    effects (free pages, tell decode, start a transfer) happen inside it."""

    def __init__(self, epoch: int, deadlines: Deadlines, free: Callable[[RequestKV], None],
                 tell: Callable[[bytes, TransferDone | TransferStarted], None], submit: Callable[[PrefillRequest], str | None],
                 may_stream: Callable[[PrefillRequest], bool] = lambda r: True):
        """may_stream(r): whether a worker may start on r while the engine still computes
        (False: it starts once the KV is computed, as for a request that does not stream)."""
        self.epoch, self.deadlines = epoch, deadlines
        self._free, self._tell, self._submit, self._may_stream = free, tell, submit, may_stream
        self._lock = threading.Condition()
        self._rooms: dict[int, PrefillRequest] = {}
        self.ended = Tombstones(ttl_s=deadlines.bootstrap_s + deadlines.waiting_s)

    # ---- arrivals --------------------------------------------------------------------------
    def prompt(self, room: int, tokens: np.ndarray, stream_auto: bool = False) -> PrefillRequest:
        """The prompt arrived (HTTP). A room that ended here fails at once. `stream_auto`: it
        streams by `auto` (may_stream decides per link)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.tokens is not None:
                raise ProtocolError(f"duplicate room {room}")
            if r is None:
                r = self._rooms[room] = PrefillRequest(room, Phase.AWAITING_DECODE)
            elif r.phase is Phase.ORPHANED:
                self._move(r, Phase.COMPUTING)
            r.tokens, r.stream_auto = tokens, stream_auto
            why = self.ended.reason(room)
            if why and not r.phase.ended:
                self._fail(r, why)
            return r

    def destination(self, room: int, peer: bytes, dst: IndexSet, slots: list[int]) -> TransferDone | None:
        """Decode's TransferRequest arrived; returns an answer to send at once, if any."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                why = self.ended.reason(room)
                if why is not None:   # this room already ended here: decode must not wait for it
                    return TransferDone(room, self.epoch, False, why)
                r = self._rooms[room] = PrefillRequest(room, Phase.ORPHANED)
            elif r.dst is not None or r.phase is not Phase.AWAITING_DECODE:
                return None           # a second TransferRequest: ignored
            else:
                self._move(r, Phase.COMPUTING)
            r.peer, r.dst, r.slots = peer, dst, list(slots)
            self._maybe_start(r)
            return None

    def streaming(self, r: PrefillRequest, kv: RequestKV, progress: LayerProgress) -> bool:
        """The engine starts computing into `kv`, reporting to `progress`: the table holds the
        pages from now on (a worker may send layers as they become final). False if r already
        ended: the caller keeps (and frees) them."""
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
                    self._tell(r.peer, TransferStarted(r.room, self.epoch))
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

    def compute_ended(self, r: PrefillRequest, why: str) -> None:
        """The engine stopped without computed() (it failed): a streamed request's pages are
        freed once no worker sends them; a live request fails with `why`."""
        with self._lock:
            if not r.computing:
                return
            r.computing = False
            if not r.phase.ended:
                self._fail(r, why)
            if r.phase.ended and r.phase is not Phase.STOPPING:
                self._release(r)

    def _maybe_start(self, r: PrefillRequest) -> None:
        if r.phase is Phase.COMPUTING and r.kv is not None and not (r.computing and not self._may_stream(r)):
            r.streamed = r.computing
            self._move(r, Phase.STREAMING if r.computing else Phase.TRANSFERRING)
            refused = self._submit(r)
            if refused:
                self._move(r, Phase.COMPUTING)   # nothing runs: fail it as not started
                self._fail(r, f"transfer workers unavailable: {refused}")

    # ---- ends ------------------------------------------------------------------------------
    def finished(self, r: PrefillRequest, ok: bool, reason: str = "", done: TransferDone | None = None,
                 settled: bool = True) -> None:
        """The transfer worker stopped writing (sent, failed or stopped); `settled` False: it gave
        up on writes in flight (their peer was lost), which may still land."""
        with self._lock:
            r.settled = settled
            if ok and r.phase is Phase.TRANSFERRING:
                self._release(r)
                self._move(r, Phase.DONE)
                if self._rooms.get(r.room) is r:
                    del self._rooms[r.room]
                self._tell(r.peer, done)
                self._lock.notify_all()
                return
            if r.phase.sending:   # else STOPPING: it keeps the reason it failed for
                r.reason = reason or "transfer failed"
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
        if r.phase.sending:
            self._move(r, Phase.STOPPING)   # the worker stops before its next write, then reports
            self._lock.notify_all()
            return
        self._move(r, Phase.FAILED)
        self._end_failed(r)

    def _end_failed(self, r: PrefillRequest) -> None:
        self._release(r)
        if self._rooms.get(r.room) is r:
            del self._rooms[r.room]
        self.ended.bury(r.room, r.reason)   # a late TransferRequest or prompt is answered at once
        if r.peer is not None:
            self._tell(r.peer, TransferDone(r.room, self.epoch, False, r.reason, settled=r.settled))
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
                    self._fail(r, deadline_passed("prefill", r.phase.name, limit, _MISSING[r.phase]))
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
                if r.peer in lost_peers:
                    self._fail(r, "decode peer silent")
                elif r.phase is Phase.ORPHANED and now - r.since > self.deadlines.waiting_s:
                    self._fail(r, "prefill never arrived")


_MISSING = {Phase.AWAITING_DECODE: "no TransferRequest from decode", Phase.ORPHANED: "the prompt never came",
            Phase.COMPUTING: "KV not computed", Phase.STREAMING: "KV not computed",
            Phase.TRANSFERRING: "send not finished"}
