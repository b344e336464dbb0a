"""The consumer (decode) side of a DisaggWorker: each Load of a scheduler step becomes a
TransferRequest to every producer rank that holds some of our heads of its room, and ends in
finished_recving: loaded, or failed with its blocks in load_errors. Never a hang: every load
ends by load_s (quarantine_s once failed while a producer rank may still write).

    Load    -> the producer ranks holding our heads (equal TP sizes: our rank; 1 -> 2:
               rank 0; 2 -> 1: both), each looked up at the bootstrap and registered with
               (the layout check on both sides: decode/introducer.py, as our decode server
               does it): the loop sends each the TransferRequest at once (num_tokens =
               first_token + tokens, the Load's blocks per kind of KV cache group:
               disagg.vllm.groups.to_wire) when every one was looked up and registered
               with before (Introducer.known: a request's common case), else a lookup
               thread does what is missing -> Introduced (then the loop sends) or IntroFailed
    TransferDone ok from every rank  -> Handoff.received(req_id)
    TransferDone failed from one     -> the others still writing are told to stop (Abort);
                                        Handoff.received(req_id, its blocks) once none may
                                        write into them (a producer that gave up on writes
                                        still in flight, settled=False, says when they ended:
                                        asked again every heartbeat), or after quarantine_s
                                        (vLLM reuses the blocks once told, so it is not told
                                        while a late byte may still land in them)
    load_s passed -> failed as above (an Abort goes to each rank that may still write);
    a producer rank silent (dead_after_s) or that dropped us -> its share failed, unsettled
               (frozen or cut off, what it wrote may land when it is back; dead, what its
               kernel still held is delivered all the same: transports/proc_tcp.py)
    Release -> Abort(room) to its producer ranks; a Release with a req_id ends that load as
               above (vLLM keeps its blocks until then); one without (never loaded) looks the
               producer ranks up first
The loop thread owns the control sockets and `loads`, and sends every TransferRequest (so it
knows a load's producer ranks before any answers); lookup threads only look up, register and
send Aborts (DealerIO.send is for any thread), and post what they found to the Handoff. A
small load's way is the loop's alone (no lookup thread, no outbox between it and its socket):
every hand-over between threads waits for the GIL, which vLLM's own thread holds through its
step's Python work (disagg.vllm.hops, scripts/bench_worker_arrival.py).
"""

import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from disagg.control.auth import Gate
from disagg.control.io import DealerIO
from disagg.control.layout import LayoutInfo
from disagg.control.messages import (
    PROTOCOL_VERSION,
    Abort,
    Heartbeat,
    RegisterDecode,
    Registered,
    Refused,
    TransferDone,
    TransferRequest,
    TransferStarted,
    indices_to_wire,
)
from disagg.decode.instances import SenderRanks
from disagg.decode.introducer import Introducer
from disagg.decode.peers import PrefillPeers
from disagg.errors import DisaggError
from disagg.vllm import hops
from disagg.vllm.groups import NULL_BLOCK, Group, to_wire
from disagg.vllm.handoff import Handoff
from disagg.vllm.params import RemotePrefill
from disagg.vllm.scheduler import Load, Release, StepMeta
from disagg.vllm.settings import ConnectorSettings
from disagg.vllm.stats import End, Ended
from transfer.receiver import KVReceiver

log = logging.getLogger(__name__)

POLL_MS = 5
SWEEP_S = 0.25
HEARTBEAT_S = 1.0
LOOKUP_THREADS = 4


class Phase(enum.Enum):
    ASKING = "asking"  # lookup, registration on their way
    WAITING = "waiting"  # the producer ranks have our request
    TRANSFERRING = "transferring"  # one started writing
    QUARANTINED = "quarantined"  # failed while a producer rank may still write: wait for its end


class Share(enum.Enum):
    """How one producer rank's share of a load stands."""

    ASKED = "asked"
    STARTED = "started"
    LOADED = "loaded"
    STOPPED = "stopped"  # failed; it writes no more
    UNSETTLED = "unsettled"  # failed with writes that may still land

    @property
    def writing(self) -> bool:
        return self in (Share.ASKED, Share.STARTED, Share.UNSETTLED)


@dataclass(eq=False)
class Loading:
    load: Load
    deadline: float
    phase: Phase = Phase.ASKING
    shares: dict[str, Share] = field(default_factory=dict)  # producer rank's endpoint -> its share
    failure: str = ""  # why it failed (QUARANTINED)
    release: str = ""  # why vLLM released it (the load goes on until the producer stopped)
    started: float = 0.0  # time.monotonic() when the loop took it (its figures: asked -> landed)
    loaded_bytes: int = 0  # what the producer ranks' reports say they wrote (the figures)

    def blocks(self) -> tuple[int, ...]:
        return tuple(b for g in self.load.block_ids for b in g if b != NULL_BLOCK)

    def writers(self) -> list[str]:
        return [e for e, share in self.shares.items() if share.writing]


@dataclass(frozen=True)
class Introduced:
    room: int
    req_id: str  # the load it is for
    endpoints: tuple[str, ...]  # the producer ranks holding our heads
    ask: TransferRequest


@dataclass(frozen=True)
class IntroFailed:
    room: int
    reason: str


class Consumer:
    def __init__(
        self,
        settings: ConnectorSettings,
        receiver: KVReceiver,
        layout: LayoutInfo,
        gate: Gate,
        handoff: Handoff,
        epoch: int,
        *,
        groups: tuple[Group, ...],
    ):
        self.settings, self.receiver, self.layout, self.handoff, self.epoch = settings, receiver, layout, handoff, epoch
        self.groups = groups
        self.io = DealerIO(gate)
        self.peers = PrefillPeers(gate, layout, settings.dead_after_s)
        self.introducer = Introducer(self.peers, SenderRanks(receiver), self.io, self._registration)
        self.loads: dict[int, Loading] = {}
        self._lookups = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="disagg-lookup")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="disagg-consumer", daemon=True)
        self._thread.start()

    def _registration(self) -> RegisterDecode:
        endpoint = self.receiver.endpoint
        pc = endpoint.pool.config
        return RegisterDecode(
            PROTOCOL_VERSION,
            self.epoch,
            self.layout,
            endpoint.offers(),
            endpoint.staging_info(),
            tp_size=pc.tp_size,
            tp_rank=pc.tp_rank,
        )

    # ---- the loop thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        next_sweep = next_beat = time.monotonic()
        while not self._stop.is_set():
            for endpoint, msg in self.io.recv(POLL_MS):
                try:
                    self._handle(endpoint, msg)
                except Exception:  # a bug or a hostile frame must not stop the control plane
                    log.exception("frame from %s failed", endpoint)
            for item in self.handoff.take():
                self._event(item)
            now = time.monotonic()
            if now >= next_beat:
                self._beat()
                next_beat = now + HEARTBEAT_S
            if now >= next_sweep:
                self._sweep(now)
                next_sweep = now + SWEEP_S

    def _event(self, item) -> None:
        match item:
            case StepMeta(loads=loads, releases=releases):
                for load in loads:
                    self._start(load)
                for rel in releases:
                    self._release(rel)
            case Introduced():
                self._introduced(item)
            case IntroFailed(room=room, reason=reason):
                r = self.loads.get(room)
                if r is not None and r.phase is Phase.ASKING:
                    self._end(r, f"no producer: {reason}")

    def _introduced(self, intro: Introduced) -> None:
        """Ask each producer rank for its share (an Abort follows if vLLM released it meanwhile)."""
        r = self.loads.get(intro.room)
        if r is None or r.phase is not Phase.ASKING or r.load.req_id != intro.req_id:
            return  # it ended meanwhile (the producer ranks let go of the room by hold_s)
        r.shares = dict.fromkeys(intro.endpoints, Share.ASKED)
        r.phase = Phase.WAITING
        hops.mark(intro.room, "c.asked")
        for endpoint in intro.endpoints:
            self.io.reply(endpoint, intro.ask)  # (the loop's own socket: registered, so it is open)
            if r.release:
                self.io.send(endpoint, Abort(intro.room, r.release))

    def _start(self, load: Load) -> None:
        room = load.remote.room
        if room in self.loads:
            log.warning(
                "room %d loaded twice (requests %s, %s): failing the second",
                room,
                self.loads[room].load.req_id,
                load.req_id,
            )
            self.handoff.received(load.req_id, Loading(load, 0.0).blocks(), Ended(End.FAILED))
            return
        hops.mark(room, "c.taken")
        now = time.monotonic()
        r = self.loads[room] = Loading(load, now + self.settings.load_s, started=now)
        dst = to_wire(self.groups, load.block_ids)
        ask = TransferRequest(room, self.epoch, load.first_token + load.num_tokens, indices_to_wire(dst), [])
        peers = self.introducer.known(load.remote.bootstrap)
        if peers is None:  # a lookup or a registration to wait for
            self._lookups.submit(self._introduce, load.remote, r.deadline, ask, load.req_id)
            return
        self._introduced(Introduced(room, load.req_id, tuple(p.endpoint for p in peers), ask))

    def _release(self, rel: Release) -> None:
        room = rel.remote.room
        r = self.loads.get(room)
        if r is None or rel.req_id is None or r.load.req_id != rel.req_id:
            if rel.req_id is None:  # never loaded: the producer still holds the room
                deadline = time.monotonic() + self.settings.load_s
                self._lookups.submit(self._introduce, rel.remote, deadline, Abort(room, rel.reason))
            return
        r.release = rel.reason
        for endpoint in r.writers():  # (none yet while ASKING: _introduced tells them)
            self.io.send(endpoint, Abort(room, rel.reason))

    def _handle(self, endpoint: str, msg) -> None:
        if isinstance(msg, Exception):
            log.warning("frame from %s refused: %s", endpoint, msg)
            return
        self.peers.heard(endpoint)
        match msg:
            case Registered(epoch=epoch, transport=transport):
                self.peers.registered(endpoint, epoch, transport)
            case Refused(reason=reason):
                if self.peers.refused(endpoint, reason):  # it dropped us after we registered
                    self._peer_lost(endpoint, f"producer {endpoint} dropped us: {reason}")
            case TransferStarted(room=room):
                r = self.loads.get(room)
                if r is not None and r.shares.get(endpoint) is Share.ASKED:
                    r.shares[endpoint] = Share.STARTED
                    r.phase = Phase.TRANSFERRING if r.phase is Phase.WAITING else r.phase
            case TransferDone():
                self._done(endpoint, msg)

    def _done(self, endpoint: str, msg: TransferDone) -> None:
        """A producer rank's last word on its share (only from the ranks asked, while it may write)."""
        hops.mark(msg.room, "c.done")
        r = self.loads.get(msg.room)
        share = r.shares.get(endpoint) if r is not None else None
        if share is None or not share.writing:
            return
        if msg.ok:
            r.shares[endpoint] = Share.LOADED
        else:  # settled: believed while none of a sender's closed connections still holds bytes here
            settled = msg.settled and not self.receiver.endpoint.unsettled()
            r.shares[endpoint] = Share.STOPPED if settled else Share.UNSETTLED
        if msg.ok and msg.report is not None:
            r.loaded_bytes += msg.report.nbytes
        if not msg.ok:
            self._fail(r, msg.reason or "producer gave up")
        self._settle(r)

    def _fail(self, r: Loading, why: str) -> None:
        """A share failed: the load fails (the first reason stands); the other producer ranks
        still asked or writing are told to stop, and its blocks stay vLLM's until none may
        write into them, at most quarantine_s."""
        if r.phase is Phase.QUARANTINED:
            return
        r.phase, r.failure = Phase.QUARANTINED, why
        r.deadline = time.monotonic() + self.settings.quarantine_s
        for endpoint, share in r.shares.items():
            if share in (Share.ASKED, Share.STARTED):
                self.io.send(endpoint, Abort(r.load.remote.room, f"another producer rank failed: {why}"))
        if r.writers():
            log.warning(
                "room %d: %s; producer ranks %s may still write: holding its blocks up to %g s",
                r.load.remote.room,
                why,
                r.writers(),
                self.settings.quarantine_s,
            )

    def _settle(self, r: Loading) -> None:
        """End the load once its outcome stands: every share loaded, or failed with no
        producer rank that may still write into its blocks."""
        if r.phase is Phase.QUARANTINED and not r.writers():
            self._end(r, r.failure)
        elif r.shares and all(s is Share.LOADED for s in r.shares.values()):
            self._end(r, "", r.loaded_bytes)

    def _end(self, r: Loading, failure: str, nbytes: int = 0) -> None:
        """Report the load over (failure "": loaded, `nbytes` written into it) and forget it."""
        del self.loads[r.load.remote.room]
        if failure and not r.release:
            log.warning("request %s (room %d): load failed: %s", r.load.req_id, r.load.remote.room, failure)
        if not failure:
            ended = Ended(End.MOVED, time.monotonic() - r.started, nbytes)
        else:  # one vLLM released is no failure of ours
            ended = None if r.release else Ended(End.FAILED)
        self.handoff.received(r.load.req_id, r.blocks() if failure else (), ended)

    def _sweep(self, now: float) -> None:
        for r in [r for r in self.loads.values() if now >= r.deadline]:
            if r.phase is Phase.QUARANTINED:
                self._end(
                    r, f"{r.failure}; the producer's writes did not settle within {self.settings.quarantine_s:g} s"
                )
                continue
            self._fail(r, f"load deadline of {self.settings.load_s:g} s passed ({r.phase.value})")
            self._settle(r)

    def _beat(self) -> None:
        for endpoint in self.peers.silent():
            self._peer_lost(endpoint, f"producer {endpoint} silent for {self.settings.dead_after_s:g} s")
        for endpoint in self.peers.abandoned():  # its registration failed
            self.io.drop(endpoint)
        for endpoint in self.peers.registered_endpoints():
            self.io.reply(endpoint, Heartbeat(self.epoch))
        for r in self.loads.values():  # ask again (an Abort or its answer may be lost; one that
            if r.phase is Phase.QUARANTINED:  # gave up on writes answers settled once they ended)
                for endpoint in r.writers():
                    self.io.send(endpoint, Abort(r.load.remote.room, r.failure))

    def _peer_lost(self, endpoint: str, reason: str) -> None:
        """Fail the loads this producer rank still had a share of: unsettled, since what it
        wrote may still land (module docstring), until it answers settled (registered again)
        or quarantine_s passes."""
        self.peers.lost(endpoint)
        self.io.drop(endpoint)
        for r in [r for r in self.loads.values() if endpoint in r.writers()]:
            r.shares[endpoint] = Share.UNSETTLED
            self._fail(r, reason)
            self._settle(r)

    # ---- a lookup thread ---------------------------------------------------------------------
    def _introduce(
        self, remote: RemotePrefill, deadline: float, msg: TransferRequest | Abort, req_id: str | None = None
    ) -> None:
        """Find the producer ranks that hold our heads of `remote.room` (registering with each
        new one): a load's TransferRequest (`req_id`: its load) goes to the loop, which sends it
        to each; an Abort goes from here."""
        hops.mark(remote.room, "c.lookup")
        try:
            peers = self.introducer.senders(remote.bootstrap, deadline)
        except (DisaggError, ValueError) as exc:
            if req_id is not None:
                self.handoff.post(IntroFailed(remote.room, str(exc)))
            else:
                log.warning("room %d: could not tell its producer to let go (%s)", remote.room, exc)
            return
        if req_id is None:
            for peer in peers:
                self.io.send(peer.endpoint, msg)
            return
        hops.mark(remote.room, "c.introduced")
        self.handoff.post(Introduced(remote.room, req_id, tuple(p.endpoint for p in peers), msg))
        self.io.wake()  # the loop sends it now, not after its poll timeout

    def wake(self) -> None:
        """From vLLM's thread, after posting a step to the Handoff: the loop takes it now."""
        self.io.wake()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._lookups.shutdown(wait=True, cancel_futures=True)
        self.io.close()
