"""The decode's requests: one phase per request, moved only here (under one lock).

    BOOTSTRAPPING --TransferRequest sent--> WAITING_FOR_INPUT --TransferStarted--> TRANSFERRING
          |                                      |                                   |
          |                                      +------- TransferDone(ok) ----------+--> SUCCESS
          |                                      +------- TransferDone(fail) --------+--> FAILED
          +--fail--> FAILED                      +------ fail (abort, deadline, ...) +--> ABORTING
    SUCCESS --abort (verifying, generating)--> FAILED: the engine stops at its next step

    ABORTING: failed here while prefill may still write into its pages  --TransferDone--> FAILED
    finish (the request's HTTP thread is done with it):
        SUCCESS, FAILED  -> pages freed, room forgotten
        ABORTING         -> QUARANTINED: pages held, Abort sent (and again every sweep) until
                            prefill's TransferDone says it stopped writing, or the cap passes
    A TransferDone that is not `settled` (prefill gave up on writes that may still land: it
    lost us with writes in flight, or a failed write's bytes are still in its kernel) ends
    nothing: TRANSFERRING -> ABORTING, and the pages stay held until a settled answer or the
    cap. A settled one counts only while no byte a sender gave up on is still arriving here
    (our own sockets: Transport.unsettled).

So a late write can never land in pages another request owns, and a room stays taken while
its pages are held. Every message about a room is checked against the prefill endpoints (and
epochs) its TransferRequests went to.

A request's KV comes from one or more prefill ranks (its senders: those holding some of this
decode rank's heads, transfer.reshard), each with staging slots of its own. TransferStarted
from any moves it to TRANSFERRING; it is SUCCESS once every sender's TransferDone(ok) came;
one failure fails it, and it is FAILED (not ABORTING) only once no sender may still write.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Protocol

import numpy as np

from disagg.control.messages import Abort, TransferDone
from disagg.control.deadlines import Deadlines, passed as deadline_passed
from disagg.control.tombstones import Tombstones
from disagg.errors import ProtocolError
from kvpool import IndexSet, RequestKV
from transfer.report import TransferReport, merged
from transfer.reshard import Lanes

if TYPE_CHECKING:
    from kvpool.cache.prefix import Hit


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
class Sender:
    """One prefill rank a request's KV comes from."""

    endpoint: str  # its control endpoint (where the TransferRequest went)
    epoch: int  # its epoch
    slots: list[int] = field(default_factory=list)  # our staging slots lent to it for this request
    lanes: Lanes | None = None  # our lanes its staged pieces name (KVReceiver.lanes_from; None: pages)
    done: TransferDone | None = None  # TransferDone(ok): its share landed
    stopped: bool = False  # it said it no longer writes (TransferDone, settled)


@dataclass(eq=False)
class DecodeRequest:
    room: int
    phase: Phase = Phase.BOOTSTRAPPING
    since: float = field(default_factory=time.monotonic)
    senders: dict[str, Sender] = field(default_factory=dict)  # endpoint -> the prefill rank
    kv: RequestKV | None = None  # set on admission
    dst: IndexSet | None = None
    prefix_len: int = 0  # positions [0, prefix_len) of the prompt decode holds already (its
    # own cached prefix, set on admission): prefill sends the rest
    hit: "Hit | None" = None  # that prefix in the prefix cache (None: no cache), held until forgotten
    kept: np.ndarray | None = None  # once it ended well: the ids of the positions whose KV it holds,
    # which the cache keeps (None: nothing of its own is kept)
    reason: str = ""
    kv_ready_at: float = 0.0  # wall clock when the last TransferDone(ok) arrived
    until: float = 0.0  # QUARANTINED: when the cap passes
    scatters: int = 0  # staged chunks handed to scatter workers and not back: its pages and
    # slots are not freed before they are (hold / let_go)

    @property
    def slots(self) -> list[int]:
        return [slot for s in self.senders.values() for slot in s.slots]

    def writing(self) -> list[Sender]:
        """Senders that may still write into its pages."""
        return [s for s in self.senders.values() if not s.stopped]


class Holdings(Protocol):
    """What the table asks of the owner of a request's pages, slots and admission place."""

    def free(self, r: DecodeRequest) -> None: ...


class RequestTable:
    """room -> DecodeRequest. Every method is one transition, atomic under the lock; its
    effects (free pages, send Abort) happen inside it."""

    def __init__(
        self,
        deadlines: Deadlines,
        quarantine_s: float,
        release: Holdings,
        send: Callable[[str, object], None],
        landing: Callable[[], int] = lambda: 0,
    ):
        """`release`: gives back what a request holds outside the table when it is forgotten
        (decode/release.py); `send`: a message to a prefill peer (the control socket's);
        `landing`: bytes a sender gave up on that are still arriving here (Transport.unsettled:
        a settled answer is believed only once there are none)."""
        self.deadlines, self.quarantine_s = deadlines, quarantine_s
        self._release, self._send, self._landing = release, send, landing
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

    def admitted(
        self, r: DecodeRequest, kv: RequestKV, dst: IndexSet, prefix_len: int = 0, hit: "Hit | None" = None
    ) -> None:
        """r holds `kv` (indices `dst`), of whose positions [0, prefix_len) it holds the KV already
        (`hit`: taken from the prefix cache, which `prefix_len` then is)."""
        with self._lock:
            r.kv, r.dst, r.hit = kv, dst, hit
            r.prefix_len = hit.prefix_len if hit is not None else prefix_len

    def generated(self, r: DecodeRequest, tokens: np.ndarray) -> bool:
        """r's generation ended well and its pool holds the KV of `tokens` (prompt and generated
        ids, one per position it holds): the cache may keep it when r is forgotten. False (and
        nothing kept) if r was failed meanwhile."""
        with self._lock:
            if r.phase is not Phase.SUCCESS:
                return False
            r.kept = tokens
            return True

    def sending(self, r: DecodeRequest, senders: list[Sender]) -> bool:
        """About to send the TransferRequests to `senders` (r holds them, and their slots, from
        now on): False if r ended meanwhile (then nothing goes out)."""
        with self._lock:
            r.senders = {s.endpoint: s for s in senders}
            if r.phase is not Phase.BOOTSTRAPPING:
                return False
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
                for s in r.writing():
                    self._send(s.endpoint, Abort(r.room, r.reason))
                return
            if not r.phase.ended:  # it never got past bootstrapping (an error)
                self._move(r, Phase.FAILED)
            self._forget(r)

    # ---- messages from prefill (the loop thread) -------------------------------------------
    def _about(self, room: int, endpoint: str) -> tuple[DecodeRequest, Sender] | tuple[None, None]:
        r = self._rooms.get(room)
        s = r.senders.get(endpoint) if r is not None else None
        return (r, s) if s is not None else (None, None)

    def started(self, room: int, endpoint: str, epoch: int) -> None:
        with self._lock:
            r, s = self._about(room, endpoint)
            if r is not None and s.epoch == epoch and r.phase is Phase.WAITING_FOR_INPUT:
                self._move(r, Phase.TRANSFERRING)

    def hold(self, room: int, endpoint: str) -> tuple[DecodeRequest, Sender] | tuple[None, None]:
        """The live request a staged chunk from `endpoint` may be scattered into (never a
        failed one), and that sender; the request's pages and slots are held (not freed, even
        once it is forgotten) until let_go."""
        with self._lock:
            r, s = self._about(room, endpoint)
            if r is None or not r.phase.sent:
                return None, None
            r.scatters += 1
            return r, s

    def live(self, r: DecodeRequest) -> bool:
        """Whether r still takes its senders' chunks (a scatter worker asks before it copies:
        a request failed or aborted while its chunk waited is never written)."""
        with self._lock:
            return r.phase.sent and self._rooms.get(r.room) is r

    def let_go(self, r: DecodeRequest) -> None:
        """A scatter held by hold() is over: r is freed now if it was forgotten meanwhile."""
        with self._lock:
            r.scatters -= 1
            if not r.scatters and self._rooms.get(r.room) is not r:
                self._release.free(r)

    def done(self, msg: TransferDone, endpoint: str) -> None:
        """A sender's last word about a room: it stopped writing."""
        with self._lock:
            r, s = self._about(msg.room, endpoint)
            if r is None:
                return
            if r.phase is Phase.QUARANTINED:  # the pages are ours again, once nothing can land
                s.stopped = s.stopped or self._settled(msg)
                if not r.writing():
                    self._forget(r)
                return
            if msg.prefill_epoch != s.epoch:
                return
            s.stopped = self._settled(msg)
            if r.phase.sent and msg.ok:
                s.done = msg
                if all(x.done is not None for x in r.senders.values()):
                    r.kv_ready_at = time.time()
                    self._move(r, Phase.SUCCESS)
            elif r.phase.sent:
                r.reason = f"prefill: {msg.reason}"
                # another sender, or writes this one gave up on (unsettled), may still land:
                # held (ABORTING, then QUARANTINED) until they say otherwise or the cap passes
                self._move(r, Phase.ABORTING if r.writing() else Phase.FAILED)
            elif r.phase is Phase.ABORTING and not r.writing():
                self._move(r, Phase.FAILED)
            self._lock.notify_all()

    def _settled(self, msg: TransferDone) -> bool:
        """Nothing of the sender's can land any more: it succeeded, or it says so and no byte
        it gave up on is still arriving here (else the sweep asks again)."""
        return msg.ok or (msg.settled and not self._landing())

    def report(self, r: DecodeRequest) -> TransferReport | None:
        """What the senders' TransferDone(ok) reported, merged (TransferReport.merge: they send
        at once); None when none reported anything."""
        with self._lock:
            return merged(s.done.report for s in r.senders.values() if s.done is not None)

    # ---- failures (any thread) --------------------------------------------------------------
    def fail(self, r: DecodeRequest, why: str) -> bool:
        """Fail r; returns whether this call ended it (or stopped its generation)."""
        with self._lock:
            return self._fail(r, why)

    def _fail(self, r: DecodeRequest, why: str) -> bool:
        if r.phase is Phase.SUCCESS:  # verifying or generating: nothing writes; the engine stops at its next step
            r.reason = why
            self._move(r, Phase.FAILED)
            return True
        if r.phase.ended:
            return False
        r.reason = why
        self._move(r, Phase.ABORTING if r.phase.sent and r.writing() else Phase.FAILED)
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
            victims = [r for r in self._rooms.values() if endpoint in r.senders and not r.phase.ended]
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
                    for s in r.writing():
                        self._send(s.endpoint, Abort(r.room, r.reason))
            return capped

    def _forget(self, r: DecodeRequest) -> None:
        if self._rooms.get(r.room) is r:
            del self._rooms[r.room]
        if not r.scatters:  # else the last let_go frees it
            self._release.free(r)

    def _move(self, r: DecodeRequest, to: Phase) -> None:
        r.phase, r.since = to, time.monotonic()

    @staticmethod
    def stopped(r: DecodeRequest) -> bool:
        """Whether r's generation must stop (it was failed after its KV arrived): the
        engine asks before every step."""
        return r.phase is not Phase.SUCCESS

    def get(self, room: int) -> DecodeRequest | None:
        with self._lock:
            return self._rooms.get(room)

    def quarantined(self) -> int:
        with self._lock:
            return sum(1 for r in self._rooms.values() if r.phase is Phase.QUARANTINED)


_MISSING = {
    Phase.WAITING_FOR_INPUT: "prefill never started the transfer",
    Phase.TRANSFERRING: "no TransferDone from prefill",
}
