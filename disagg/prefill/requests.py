"""The prefill's requests: one record per request, its state moved only here (under one lock).

A request meets two halves in either order: the prompt (HTTP /prefill) and decode's
destinations (a TransferRequest over the control socket from every decode rank this prefill
rank sends to: one, unless the two instances' TP sizes differ; the first one's TP size says
which ranks to expect). Its state has three axes, each an enum that only moves forward (a
move its table does not list raises IllegalTransition: a bug, never a request's failure):

    Phase (the request)
    prompt first:     AWAITING_DECODE --last TransferRequest--> COMPUTING --KV ready--> TRANSFERRING
    request first:    ORPHANED --------prompt (+ every one)---> COMPUTING
                      ORPHANED --prompt, a destination missing--> AWAITING_DECODE
    streamed:         COMPUTING --KV streaming (may_stream)--> STREAMING --KV ready--> TRANSFERRING
    TRANSFERRING --every destination sent--> DONE   (COMPUTING --> DONE: we feed no decode rank)
    TRANSFERRING, STREAMING --fail (any destination)--> STOPPING --no worker writes--> FAILED
    any other live phase --fail--> FAILED

    Compute (its pages: who holds them, whether the engine still writes them)
    PENDING --allocated--> ALLOCATED --computed--> COMPUTED --released--> RELEASED
    PENDING --streaming (first layer final)--> STREAMING --computed--> COMPUTED
                                               STREAMING --engine raised--> BROKEN --released--> RELEASED
    PENDING, ALLOCATED --computed or engine raised, r ended--> RELEASED (the HTTP thread's pages freed)

    Delivery (each destination)
    WAITING --its worker started--> WRITING --its worker stopped--> STOPPED --TransferDone--> TOLD
    WAITING --TransferDone(fail): r failed before a worker started--> TOLD

Its pages belong to exactly one holder at a time: the HTTP thread computing its KV (PENDING,
ALLOCATED), or this table (STREAMING, COMPUTED, BROKEN), which lends them to the transfer
workers (a job per destination, or one fan-out job for all) and frees them once none writes
and the engine let go.

Why a streamed request is handed over at the engine's first layer and not before the engine
is called: an engine runs one forward pass at a time (a real one batches behind one loop),
and a transfer worker that streams a request blocks until that request's layers are final.
Handed over early, a request queued behind others for the engine would hold one of its decode
peer's workers all that time, and a request that computed meanwhile would wait for that worker
(tests/disagg/prefill/test_prefill_workers.py has both). Nothing is lost: no layer goes before the
first is final. A request that ended before its first layer is refused: the HTTP thread keeps
the pages, as for one not streamed, and computed() or compute_ended() frees them.

Each destination hears the end exactly once: TransferDone(ok) as soon as its own send
finished (its KV is complete), TransferDone(fail) on entering FAILED if it has not heard (or,
if it is not known yet, through a tombstone that answers its late TransferRequest). A room's
decode rank is claimed by one connection: another connection's TransferRequest for it, or
one from an instance of another TP size, is refused and changes nothing. Deadlines per phase,
counted from entering it: AWAITING_DECODE bootstrap_s; ORPHANED, COMPUTING and STREAMING
waiting_s; TRANSFERRING transfer_s.

The table's effects outside it (free pages, tell decode, prepare and start sends) are its
TransferJobs' (prefill/jobs.py), given once at construction; a transfer worker reports the end
of each destination's send to `finished`, which the table hands it with the job. Whether the
destinations go a job each or as one fan-out (one job, one write into every decode rank) is
the jobs' choice: every destination moves WAITING -> WRITING -> STOPPED -> TOLD either way.
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol, TypeVar

import numpy as np

from disagg.control.deadlines import Deadlines, passed as deadline_passed
from disagg.control.messages import TransferDone, TransferStarted
from disagg.control.tombstones import Tombstones
from disagg.errors import ProtocolError
from kvpool import IndexSet, RequestKV
from kvpool.cache.prefix import Hit
from transfer.progress import LayerProgress
from transfer.report import TransferReport, merged


S = TypeVar("S", bound=Enum)


class IllegalTransition(RuntimeError):
    """A move the state's table does not list: a bug in the caller, not a request's failure."""


class Phase(Enum):
    AWAITING_DECODE = "waiting for decode's TransferRequest"
    ORPHANED = "decode's TransferRequest here, the prompt not yet"
    COMPUTING = "the prompt and every destination here; the KV not ready to send"
    STREAMING = "KV being computed while a worker sends the layers that are final"
    TRANSFERRING = "a transfer worker is sending"
    STOPPING = "failed while a worker writes; decode hears it when the worker stops"
    DONE = "sent"
    FAILED = "failed"

    @property
    def ended(self) -> bool:
        """Over for the caller waiting on it (STOPPING included: it will never succeed)."""
        return self in _ENDED

    def deadline(self, d: Deadlines) -> float:
        return {Phase.AWAITING_DECODE: d.bootstrap_s, Phase.TRANSFERRING: d.transfer_s}.get(self, d.waiting_s)

    @property
    def sending(self) -> bool:
        """A transfer worker may be writing (a sender asks before every write)."""
        return self in _SENDING


# (module tuples: an enum member read off its class costs a lookup through the metaclass, and
# these are asked on every transition and before every write)
_ENDED = (Phase.STOPPING, Phase.DONE, Phase.FAILED)
_SENDING = (Phase.STREAMING, Phase.TRANSFERRING)


class Compute(Enum):
    PENDING = "its HTTP thread holds the pages (admitting, computing): the table has not seen them"
    ALLOCATED = "as PENDING, the pages' indices known: each destination's send is laid out meanwhile"
    STREAMING = "the engine computes into pages the table holds (its first layer is final)"
    COMPUTED = "the engine returned: the table holds the whole KV"
    BROKEN = "the engine raised while the table held the pages: the table's alone, not whole"
    RELEASED = "the pages went back to the pool"


class Delivery(Enum):
    WAITING = "here; no worker has started sending to it"
    WRITING = "its transfer worker sends to it"
    STOPPED = "its worker stopped; it hears the end with the others"
    TOLD = "it heard the end (TransferDone)"


_NEXT = {
    Phase.AWAITING_DECODE: {Phase.COMPUTING, Phase.FAILED},
    Phase.ORPHANED: {Phase.AWAITING_DECODE, Phase.COMPUTING, Phase.FAILED},
    Phase.COMPUTING: {Phase.STREAMING, Phase.TRANSFERRING, Phase.DONE, Phase.FAILED},
    Phase.STREAMING: {Phase.TRANSFERRING, Phase.STOPPING, Phase.FAILED},
    Phase.TRANSFERRING: {Phase.DONE, Phase.STOPPING, Phase.FAILED},
    Phase.STOPPING: {Phase.FAILED},
    Phase.DONE: set(),
    Phase.FAILED: set(),
    Compute.PENDING: {Compute.ALLOCATED, Compute.STREAMING, Compute.COMPUTED, Compute.RELEASED},
    Compute.ALLOCATED: {Compute.COMPUTED, Compute.RELEASED},
    Compute.STREAMING: {Compute.COMPUTED, Compute.BROKEN},
    Compute.COMPUTED: {Compute.RELEASED},
    Compute.BROKEN: {Compute.RELEASED},
    Compute.RELEASED: set(),
    Delivery.WAITING: {Delivery.WRITING, Delivery.TOLD},
    Delivery.WRITING: {Delivery.STOPPED},
    Delivery.STOPPED: {Delivery.TOLD},
    Delivery.TOLD: set(),
}
for _now, _moves in _NEXT.items():  # kept on the member as a tuple: `in` then compares by identity,
    _now.moves = tuple(_moves)  # where a set would call Enum.__hash__ (Python) on every move


def step(now: Enum, to: S) -> S:
    """`to`, if the axis may move there from `now`; else IllegalTransition."""
    if to not in now.moves:
        raise IllegalTransition(f"{type(now).__name__} {now.name} -> {to.name} is not a move of its table")
    return to


@dataclass(eq=False)
class Destination:
    """One decode rank a request's KV goes to: several when the TP sizes differ.

    TP 1 -> 2:  prefill rank 0 --half the heads--> decode rank 0
                               --the other half--> decode rank 1      (two destinations)
    TP 2 -> 1:  prefill rank r --its heads--> decode rank 0           (one destination each)
    """

    peer: bytes  # its control identity
    rank: int  # its TP rank
    dst: IndexSet  # its destination indices
    slots: list[int]  # its staging slots lent to this transfer
    delivery: Delivery = Delivery.WAITING
    prepared: Future | None = None  # its send laid out while the KV computes (TransferJobs.prepare_all);
    # its transfer worker takes it
    report: TransferReport | None = None  # what its send did (None: it has not finished)
    prefix_len: int = 0  # it holds the prompt's positions [0, prefix_len) already: the rest goes


@dataclass(eq=False)
class PrefillRequest:
    room: int
    phase: Phase
    compute: Compute = Compute.PENDING
    since: float = field(default_factory=time.monotonic)  # when the phase began
    tokens: np.ndarray | None = None  # the prompt (None while ORPHANED)
    kv: RequestKV | None = None  # the pages the table holds (STREAMING, COMPUTED, BROKEN)
    src: IndexSet | None = None  # their indices from ALLOCATED on (sends are prepared then)
    progress: LayerProgress | None = None  # STREAMING on: which layers the engine has finished
    dests: dict[int, Destination] = field(default_factory=dict)  # decode rank -> where its share goes
    receivers: frozenset[int] | None = None  # the decode ranks to expect (from the first one's TP size)
    tp_size: int = 0  # the decode instance's TP size
    stream_auto: bool = False  # streams by `auto`: only over a link that leaves the compute alone
    settled: bool = True  # False: its writes were abandoned in flight (peer lost): decode is
    # told so, and keeps the pages until the cap (TransferDone.settled)
    reason: str = ""
    timings: dict = field(default_factory=dict)
    digest: Future | None = None  # (kvpool.digest of its KV, ms), computed beside the sends: each
    # TransferDone(ok) waits for it and carries its destination's units
    hit: Hit | None = None  # the cached prefix its pages start with (prefill's prefix cache; None: off)
    kept: np.ndarray | None = None  # the ids of its leading positions the cache may keep once freed
    # (set when the engine computed them and nothing corrupted them; None: none)

    @property
    def complete(self) -> bool:
        """Every destination this request expects is here."""
        return self.receivers is not None and self.receivers == self.dests.keys()

    @property
    def writers(self) -> int:
        return sum(d.delivery is Delivery.WRITING for d in self.dests.values())

    def peers(self) -> set[bytes]:
        return {d.peer for d in self.dests.values()}


class Finished(Protocol):
    """RequestTable.finished, as a transfer worker reports to it."""

    def __call__(
        self,
        r: PrefillRequest,
        ok: bool,
        reason: str = "",
        done: TransferDone | None = None,
        settled: bool = True,
        dest: Destination | None = None,
    ) -> None: ...


class Jobs(Protocol):
    """What the table's transitions do outside it (prefill/jobs.py: TransferJobs)."""

    def free(self, kv: RequestKV, r: PrefillRequest) -> None: ...
    def tell(self, peer: bytes, msg: TransferDone | TransferStarted) -> None: ...
    def may_stream(self, r: PrefillRequest) -> bool: ...
    def unsettled(self) -> bool: ...
    def prepare_all(self, r: PrefillRequest, dests: list[Destination]) -> list[Future | None]: ...
    def submit_all(
        self, r: PrefillRequest, dests: list[Destination], progress: LayerProgress | None, finished: Finished
    ) -> tuple[int, str | None]: ...


class RequestTable:
    """room -> PrefillRequest. Every method is one transition, atomic under the lock; its
    effects (free pages, tell decode, start a transfer) happen inside it, through `jobs`."""

    def __init__(self, epoch: int, deadlines: Deadlines, jobs: Jobs):
        self.epoch, self.deadlines, self._jobs = epoch, deadlines, jobs
        self._lock = threading.Condition()
        self._rooms: dict[int, PrefillRequest] = {}
        self.ended = Tombstones(ttl_s=deadlines.bootstrap_s + deadlines.waiting_s)

    # ---- arrivals (the prompt: its HTTP thread; a destination: the loop thread) ------------
    def prompt(
        self,
        room: int,
        tokens: np.ndarray,
        stream_auto: bool = False,
        receivers: frozenset[int] | None = None,
        tp_size: int = 0,
    ) -> PrefillRequest:
        """The prompt arrived (HTTP). A room that ended here fails at once. `stream_auto`: it
        streams by `auto` (TransferJobs.may_stream decides per link). `receivers`: the decode
        ranks (of an instance of `tp_size`) to expect, where the caller knows them (None: the
        first TransferRequest says); none at all: sent once computed."""
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
            elif r.phase is Phase.AWAITING_DECODE and r.complete:  # no decode rank to wait for
                self._move(r, Phase.COMPUTING)
            r.tokens, r.stream_auto = tokens, stream_auto
            if why and not r.phase.ended:
                self._fail(r, why)
            return r

    def destination(
        self,
        room: int,
        peer: bytes,
        dst: IndexSet,
        slots: list[int],
        rank: int = 0,
        tp_size: int = 1,
        *,
        receivers: frozenset[int] = frozenset({0}),
        prefix_len: int = 0,
    ) -> TransferDone | None:
        """Decode rank `rank` (of an instance of `tp_size`, of which we send to `receivers`)
        sent its TransferRequest; returns an answer to send at once, if any."""
        with self._lock:
            r = self._rooms.get(room)
            why = self.ended.reason(room) if r is None else None
            if why is not None:  # this room already ended here: decode must not wait for it
                return TransferDone(room, self.epoch, False, reason=why)
            claimed = r.dests.get(rank) if r is not None else None
            if claimed is not None and claimed.peer == peer:
                return None  # a second TransferRequest: ignored
            refusal = self._refusal(room, r, rank, tp_size, receivers, claimed)
            if refusal:  # nothing changes
                return TransferDone(room, self.epoch, False, reason=refusal)
            if r is None:
                r = self._rooms[room] = PrefillRequest(room, Phase.ORPHANED)
            if r.phase.ended:  # STOPPING: it will not be sent
                return TransferDone(room, self.epoch, False, reason=r.reason)
            r.receivers, r.tp_size = receivers, tp_size
            r.dests[rank] = Destination(peer, rank, dst, list(slots), prefix_len=prefix_len)
            if r.phase is Phase.AWAITING_DECODE and r.complete:
                self._move(r, Phase.COMPUTING)
            self._maybe_start(r)
            self._maybe_prepare(r)
            return None

    @staticmethod
    def _refusal(
        room: int,
        r: PrefillRequest | None,
        rank: int,
        tp_size: int,
        receivers: frozenset[int],
        claimed: Destination | None,
    ) -> str | None:
        if claimed is not None:
            return f"decode rank {rank} of room {room} is claimed by another connection"
        if r is not None and r.receivers is not None and r.tp_size != tp_size:
            return f"room {room} goes to a decode instance of TP size {r.tp_size}, not {tp_size}"
        if rank not in receivers:
            return f"this prefill rank holds none of decode rank {rank}'s share of the KV"
        return None

    # ---- the engine (the request's HTTP thread) ---------------------------------------------
    def allocated(self, r: PrefillRequest, src: IndexSet) -> None:
        """The engine starts computing into pages of indices `src` (the caller keeps them until
        computed()): the sends of the destinations here, and of those that come meanwhile,
        are laid out now, so that they only start writes once the KV is computed."""
        with self._lock:
            if r.phase.ended:
                return
            if r.compute is not Compute.ALLOCATED:  # (a second call: nothing new)
                r.src, r.compute = src, step(r.compute, Compute.ALLOCATED)
            self._maybe_prepare(r)

    def _maybe_prepare(self, r: PrefillRequest) -> None:
        if r.compute is not Compute.ALLOCATED or r.phase not in (Phase.AWAITING_DECODE, Phase.COMPUTING):
            return
        waiting = [d for d in r.dests.values() if d.prepared is None]
        if waiting:  # (a job each, or one for all: the jobs' choice)
            for d, job in zip(waiting, self._jobs.prepare_all(r, waiting)):
                d.prepared = job

    def handover(self, r: PrefillRequest, kv: RequestKV, progress: LayerProgress) -> Callable[[int], None]:
        """A streamed request's on_layer hook (called on the engine's thread): each layer goes
        to `progress`; at the first, the table takes the pages (streaming(); refused, and
        asked again at the next layer, if r ended: the HTTP thread keeps them)."""

        def final(layer: int) -> None:
            progress.final(layer)  # (on a GPU: its kernels are queued; progress records an event)
            if r.compute is Compute.PENDING:  # moved only by this thread until the table has them
                self.streaming(r, kv, progress)

        return final

    def streaming(self, r: PrefillRequest, kv: RequestKV, progress: LayerProgress) -> bool:
        """The engine computes into `kv` (its first layer is final), reporting to `progress`:
        the table holds the pages from now on (a worker may send layers as they become final,
        once every destination is here and may_stream agrees). False if r already ended: the
        HTTP thread keeps them, and computed() or compute_ended() frees them."""
        with self._lock:
            if r.phase.ended:
                return False
            r.kv, r.progress, r.compute = kv, progress, step(r.compute, Compute.STREAMING)
            self._maybe_start(r)
            return True

    def computed(self, r: PrefillRequest, kv: RequestKV) -> None:
        """The KV is computed into `kv`: the table holds it now (and frees it if r ended)."""
        with self._lock:
            if r.compute is Compute.STREAMING:  # the table holds kv already
                r.compute = step(r.compute, Compute.COMPUTED)
                r.progress.complete()
                if r.phase is Phase.STREAMING:
                    self._move(r, Phase.TRANSFERRING)
                    for d in r.dests.values():
                        self._jobs.tell(d.peer, TransferStarted(r.room, self.epoch))
                elif r.phase in (Phase.DONE, Phase.FAILED):
                    self._release(r)
                else:  # its worker waited for the engine (may_stream), or decode is not here yet;
                    self._maybe_start(r)  # STOPPING: the last worker's report releases them
                return
            if r.phase.ended:
                self._free_unseen(r, kv)
                return
            r.kv, r.compute = kv, step(r.compute, Compute.COMPUTED)
            self._maybe_start(r)

    def compute_ended(self, r: PrefillRequest, kv: RequestKV, why: str) -> None:
        """The engine raised (no computed()) while computing into `kv`: a live r fails with
        `why`; the pages are freed now, or, if the table holds them (streamed), once no worker
        sends them. One decision under the lock: a later streaming() finds r ended."""
        with self._lock:
            held = r.compute is Compute.STREAMING
            if held:
                r.compute = step(r.compute, Compute.BROKEN)
            if not r.phase.ended:
                self._fail(r, why)
            if not held:
                self._free_unseen(r, kv)
            elif r.phase is not Phase.STOPPING:
                self._release(r)

    def _maybe_start(self, r: PrefillRequest) -> None:
        if r.phase is not Phase.COMPUTING or not r.complete or r.compute not in (Compute.STREAMING, Compute.COMPUTED):
            return
        streams = r.compute is Compute.STREAMING
        if streams and not self._jobs.may_stream(r):
            return  # its worker starts once the KV is computed
        if not r.dests:  # we hold none of the decode instance's share (another rank sends it)
            if not streams:
                self._release(r)
                self._done(r)
            return
        self._move(r, Phase.STREAMING if streams else Phase.TRANSFERRING)
        dests = list(r.dests.values())  # (a job per destination, or one for all: the jobs' choice)
        started, refused = self._jobs.submit_all(r, dests, r.progress if streams else None, self.finished)
        for d in dests[:started]:  # (their workers report under this lock: after these moves)
            d.delivery = step(d.delivery, Delivery.WRITING)
        if refused:
            self._fail(r, f"transfer workers unavailable: {refused}")  # the started ones stop

    # ---- ends (a transfer worker, or any thread failing r) ------------------------------------
    def finished(
        self,
        r: PrefillRequest,
        ok: bool,
        reason: str = "",
        done: TransferDone | None = None,
        settled: bool = True,
        dest: Destination | None = None,
    ) -> None:
        """The transfer worker of `dest` (None: the only one) stopped writing (sent, failed or
        stopped); `settled` False: it gave up on writes in flight (their peer was lost), which
        may still land."""
        with self._lock:
            d = dest or next(iter(r.dests.values()))
            d.delivery, r.settled = step(d.delivery, Delivery.STOPPED), r.settled and settled
            if ok and done is not None:
                d.report = done.report
            if ok and r.phase is Phase.TRANSFERRING:
                self._tell(d, done)  # its KV is complete: it need not wait for the others
                if all(x.delivery is Delivery.TOLD for x in r.dests.values()):
                    self._release(r)
                    self._done(r)
            elif r.phase.sending:  # else STOPPING: it keeps the reason it failed for
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
            self._move(r, Phase.STOPPING)  # the workers stop before their next write, then report
            self._lock.notify_all()
            return
        self._move(r, Phase.FAILED)
        self._end_failed(r)

    def _end_failed(self, r: PrefillRequest) -> None:
        self._release(r)
        self._forget(r)
        self.ended.bury(r.room, r.reason)  # a late TransferRequest or prompt is answered at once
        untold = [d for d in r.dests.values() if d.delivery is not Delivery.TOLD]
        # settled: no write of r was given up on, and none of the process's bytes nobody waits
        # for is still on its way (a failed write's may be: transports/mooncake.py, late bytes)
        settled = r.settled and not (untold and self._jobs.unsettled())
        for d in untold:
            self._tell(d, TransferDone(r.room, self.epoch, False, reason=r.reason, settled=settled))
        self._lock.notify_all()

    def _done(self, r: PrefillRequest) -> None:
        self._move(r, Phase.DONE)
        self._forget(r)
        self._lock.notify_all()

    def _tell(self, d: Destination, msg: TransferDone) -> None:
        d.delivery = step(d.delivery, Delivery.TOLD)
        self._jobs.tell(d.peer, msg)

    def _release(self, r: PrefillRequest) -> None:
        """Free the pages the table holds, once the engine let go (STREAMING: computed() or
        compute_ended() releases them)."""
        if r.compute in (Compute.COMPUTED, Compute.BROKEN):
            kv, r.kv, r.compute = r.kv, None, step(r.compute, Compute.RELEASED)
            self._jobs.free(kv, r)

    def _free_unseen(self, r: PrefillRequest, kv: RequestKV) -> None:
        """The HTTP thread's pages, which the table never held (r ended first)."""
        if r.compute not in (Compute.PENDING, Compute.ALLOCATED):  # the table's: freeing kv too would free twice
            raise IllegalTransition(f"Compute {r.compute.name}: the table holds room {r.room}'s pages, not its caller")
        r.compute = step(r.compute, Compute.RELEASED)
        self._jobs.free(kv, r)

    def _forget(self, r: PrefillRequest) -> None:
        if self._rooms.get(r.room) is r:
            del self._rooms[r.room]

    def _move(self, r: PrefillRequest, to: Phase) -> None:
        r.phase, r.since = step(r.phase, to), time.monotonic()

    # ---- lookups, waits, sweeps -------------------------------------------------------------
    def get(self, room: int) -> PrefillRequest | None:
        with self._lock:
            return self._rooms.get(room)

    def report(self, r: PrefillRequest) -> TransferReport | None:
        """What its destinations' sends reported, merged (TransferReport.merge: they send at
        once); None when none has sent."""
        with self._lock:
            return merged(d.report for d in r.dests.values())

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
                if r.peers() & lost_peers:
                    self._fail(r, "decode peer silent")
                elif r.phase is Phase.ORPHANED and now - r.since > self.deadlines.waiting_s:
                    self._fail(r, "prefill never arrived")


_MISSING = {
    Phase.AWAITING_DECODE: "no TransferRequest from decode",
    Phase.ORPHANED: "the prompt never came",
    Phase.COMPUTING: "KV not computed",
    Phase.STREAMING: "KV not computed",
    Phase.TRANSFERRING: "send not finished",
}
