"""The decode's requests: one phase per request, moved only here (under one lock).

    BOOTSTRAPPING --TransferRequest sent--> WAITING_FOR_INPUT --TransferStarted--> TRANSFERRING
          |                                      |                                   |
          |                                      +------- TransferDone(ok) ----------+--> SUCCESS
          |                                      +------- TransferDone(fail) --------+--> FAILED
          +--fail--> FAILED                      +------ fail (abort, deadline, ...) +--> ABORTING

    ABORTING: failed here while prefill may still write into its pages  --TransferDone--> FAILED
    finish (the request's HTTP thread is done with it):
        SUCCESS, FAILED  -> pages freed, room forgotten
        ABORTING         -> QUARANTINED: pages held, Abort sent (and again every sweep) until
                            prefill's TransferDone says it stopped writing, or the cap passes
    A TransferDone that is not `settled` (prefill gave up on writes that may still land: it
    lost us with writes in flight) ends nothing: TRANSFERRING -> ABORTING, and the pages stay
    held until a settled answer or the cap.

So a late write can never land in pages another request owns, and a room stays taken while
its pages are held. Every message about a room is checked against the prefill endpoint (and
epoch) its TransferRequest went to.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from disagg.control.messages import Abort, TransferDone
from disagg.control.deadlines import Deadlines, passed as deadline_passed
from disagg.control.tombstones import Tombstones
from disagg.errors import ProtocolError
from kvpool import IndexSet, RequestKV


class Phase(Enum):
    BOOTSTRAPPING = "lookup, registration, admission"
    WAITING_FOR_INPUT = "TransferRequest sent; prefill has not started"
    TRANSFERRING = "prefill is writing"
    SUCCESS = "the KV arrived"
    FAILED = "failed; nothing writes into its pages"
    ABORTING = "failed here; prefill may still be writing"
    QUARANTINED = "failed, pages held until prefill confirms it stopped writing"

    @property
    def ended(self) -> bool:
        return self in (Phase.SUCCESS, Phase.FAILED, Phase.ABORTING, Phase.QUARANTINED)

    @property
    def sent(self) -> bool:
        """Live, and prefill may be writing into its pages."""
        return self in (Phase.WAITING_FOR_INPUT, Phase.TRANSFERRING)


@dataclass(eq=False)
class DecodeRequest:
    room: int
    phase: Phase = Phase.BOOTSTRAPPING
    since: float = field(default_factory=time.monotonic)
    endpoint: str = ""                # the prefill's control endpoint its TransferRequest went to
    epoch: int = 0                    # that prefill's epoch
    kv: RequestKV | None = None       # set on admission
    dst: IndexSet | None = None
    slots: list[int] = field(default_factory=list)
    reason: str = ""
    done: TransferDone | None = None
    kv_ready_at: float = 0.0          # wall clock when TransferDone(ok) arrived
    until: float = 0.0                # QUARANTINED: when the cap passes


class RequestTable:
    """room -> DecodeRequest. Every method is one transition, atomic under the lock; its
    effects (free pages, send Abort) happen inside it."""

    def __init__(self, deadlines: Deadlines, quarantine_s: float, free: Callable[[DecodeRequest], None],
                 send: Callable[[str, object], None]):
        self.deadlines, self.quarantine_s = deadlines, quarantine_s
        self._free, self._send = free, send
        self._lock = threading.Condition()
        self._rooms: dict[int, DecodeRequest] = {}
        self.ended = Tombstones(ttl_s=deadlines.bootstrap_s + deadlines.waiting_s)

    # ---- the request's own thread -----------------------------------------------------------
    def open(self, room: int) -> DecodeRequest:
        """A new request; a room that is taken (live or quarantined) raises ProtocolError, a
        room that ended here fails at once."""
        with self._lock:
            if room in self._rooms:
                raise ProtocolError(f"duplicate room {room}")
            r = self._rooms[room] = DecodeRequest(room)
            why = self.ended.reason(room)
            if why:
                self._fail(r, why)
            return r

    def admitted(self, r: DecodeRequest, kv: RequestKV, dst: IndexSet, slots: list[int]) -> None:
        with self._lock:
            r.kv, r.dst, r.slots = kv, dst, slots

    def sending(self, r: DecodeRequest, endpoint: str, epoch: int) -> bool:
        """About to send the TransferRequest: False if r ended meanwhile (then nothing goes out)."""
        with self._lock:
            if r.phase is not Phase.BOOTSTRAPPING:
                return False
            r.endpoint, r.epoch = endpoint, epoch
            self._move(r, Phase.WAITING_FOR_INPUT)
            return True

    def wait(self, r: DecodeRequest) -> Phase:
        """Block until r ended, failing it when its phase outlives its deadline."""
        with self._lock:
            while not r.phase.ended:
                limit = self.deadlines.transfer_s if r.phase is Phase.TRANSFERRING else self.deadlines.waiting_s
                left = r.since + limit - time.monotonic()
                if left <= 0:
                    self._fail(r, deadline_passed("decode", r.phase.name, limit, _MISSING[r.phase]))
                    break
                self._lock.wait(left)
            return r.phase

    def finish(self, r: DecodeRequest) -> None:
        """The request's thread is done with it: free now, or quarantine while prefill may
        still write (and tell prefill)."""
        with self._lock:
            if r.phase is Phase.ABORTING:
                self._move(r, Phase.QUARANTINED)
                r.until = time.monotonic() + self.quarantine_s
                self._send(r.endpoint, Abort(r.room, r.reason))
                return
            if not r.phase.ended:   # it never got past bootstrapping (an error)
                self._move(r, Phase.FAILED)
            self._forget(r)

    # ---- messages from prefill (the loop thread) -------------------------------------------
    def _about(self, room: int, endpoint: str) -> DecodeRequest | None:
        r = self._rooms.get(room)
        return r if r is not None and r.endpoint == endpoint else None

    def started(self, room: int, endpoint: str, epoch: int) -> None:
        with self._lock:
            r = self._about(room, endpoint)
            if r is not None and r.epoch == epoch and r.phase is Phase.WAITING_FOR_INPUT:
                self._move(r, Phase.TRANSFERRING)

    def receiving(self, room: int, endpoint: str) -> DecodeRequest | None:
        """The live request a staged chunk may be scattered into (never a failed one)."""
        with self._lock:
            r = self._about(room, endpoint)
            return r if r is not None and r.phase.sent else None

    def done(self, msg: TransferDone, endpoint: str) -> None:
        """Prefill's last word about a room: it stopped writing."""
        with self._lock:
            r = self._about(msg.room, endpoint)
            if r is None:
                return
            if r.phase is Phase.QUARANTINED:      # the pages are ours again, once nothing can land
                if msg.settled:
                    self._forget(r)
                return
            if msg.prefill_epoch != r.epoch:
                return
            if r.phase.sent and msg.ok:
                r.done, r.kv_ready_at = msg, time.time()
                self._move(r, Phase.SUCCESS)
            elif r.phase.sent:
                r.reason = f"prefill: {msg.reason}"
                # unsettled: writes given up on may still land: held (QUARANTINED) until
                # prefill says otherwise or the cap passes
                self._move(r, Phase.FAILED if msg.settled else Phase.ABORTING)
            elif r.phase is Phase.ABORTING and msg.settled:
                self._move(r, Phase.FAILED)
            self._lock.notify_all()

    # ---- failures (any thread) --------------------------------------------------------------
    def fail(self, r: DecodeRequest, why: str) -> bool:
        """Fail r; returns whether this call ended it."""
        with self._lock:
            return self._fail(r, why)

    def _fail(self, r: DecodeRequest, why: str) -> bool:
        if r.phase.ended:
            return False
        r.reason = why
        self._move(r, Phase.ABORTING if r.phase.sent else Phase.FAILED)
        self._lock.notify_all()
        return True

    def abort(self, room: int, why: str) -> DecodeRequest | None:
        """Fail a room by number; an unknown room is remembered as ended."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                self.ended.bury(room, why)
                return None
            self._fail(r, why)
            return r

    def peer_lost(self, endpoint: str, why: str) -> int:
        """Fail exactly the requests sent to this prefill (pages stay held: it may be frozen)."""
        with self._lock:
            victims = [r for r in self._rooms.values() if r.endpoint == endpoint and not r.phase.ended]
            for r in victims:
                self._fail(r, why)
            return len(victims)

    def sweep(self) -> list[DecodeRequest]:
        """Release quarantined requests whose cap passed; ask again (Abort) about the others (an
        Abort or its TransferDone may have been lost). Returns the ones released at the cap."""
        now = time.monotonic()
        with self._lock:
            held = [r for r in self._rooms.values() if r.phase is Phase.QUARANTINED]
            capped = [r for r in held if r.until <= now]
            for r in capped:
                self._forget(r)
            for r in held:
                if r.until > now:
                    self._send(r.endpoint, Abort(r.room, r.reason))
            return capped

    def _forget(self, r: DecodeRequest) -> None:
        if self._rooms.get(r.room) is r:
            del self._rooms[r.room]
        self._free(r)

    def _move(self, r: DecodeRequest, to: Phase) -> None:
        r.phase, r.since = to, time.monotonic()

    def get(self, room: int) -> DecodeRequest | None:
        with self._lock:
            return self._rooms.get(room)

    def quarantined(self) -> int:
        with self._lock:
            return sum(1 for r in self._rooms.values() if r.phase is Phase.QUARANTINED)


_MISSING = {Phase.WAITING_FOR_INPUT: "prefill never started the transfer",
            Phase.TRANSFERRING: "no TransferDone from prefill"}
