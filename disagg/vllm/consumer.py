"""The consumer (decode) side of a DisaggWorker: each Load of a scheduler step becomes a
TransferRequest to the producer that holds its room, and ends in finished_recving: loaded,
or failed with its blocks in load_errors. Never a hang: every load ends by load_s.

    Load    -> a lookup thread: bootstrap lookup + registration (the layout check on both
               sides: decode/introducer.py, as our decode server does it), then
               TransferRequest(room, num_tokens = first_token + tokens, the Load's blocks per
               kind of KV cache group: disagg.vllm.groups.to_wire)
               -> Introduced (the loop learns which producer serves the room) or IntroFailed
    TransferDone ok           -> Handoff.received(req_id)
    TransferDone failed       -> Handoff.received(req_id, its blocks); a producer that gave
                                 up on writes still in flight (settled=False): only once it
                                 says they ended, or after quarantine_s (vLLM keeps the blocks)
    load_s passed, producer silent (dead_after_s) or it dropped us -> failed likewise (an
                                 Abort goes to a producer we know)
    Release -> Abort(room) to its producer; a Release with a req_id ends that load as above
               (vLLM keeps its blocks until then); one without (never loaded) looks the
               producer up first
The loop thread owns the control sockets and `loads`; lookup threads only look up, register
and send (DealerIO.send is for any thread) and post what they found to the Handoff.
"""

import enum
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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
    ASKING = "asking"  # lookup, registration, TransferRequest on their way
    WAITING = "waiting"  # the producer has our request
    TRANSFERRING = "transferring"  # it started writing
    QUARANTINED = "quarantined"  # it failed with writes in flight: wait for their end


@dataclass(eq=False)
class Loading:
    load: Load
    deadline: float
    phase: Phase = Phase.ASKING
    endpoint: str | None = None
    release: str = ""  # why vLLM released it (the load goes on until the producer stopped)
    started: float = 0.0  # time.monotonic() when the loop took it (its figures: asked -> landed)

    def blocks(self) -> tuple[int, ...]:
        return tuple(b for g in self.load.block_ids for b in g if b != NULL_BLOCK)


@dataclass(frozen=True)
class Introduced:
    room: int
    endpoint: str


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
            case Introduced(room=room, endpoint=endpoint):
                r = self.loads.get(room)
                if r is not None and r.endpoint is None:  # (its TransferStarted may have come first)
                    r.endpoint = endpoint
                    r.phase = Phase.WAITING if r.phase is Phase.ASKING else r.phase
                    if r.release:
                        self.io.send(endpoint, Abort(room, r.release))
            case IntroFailed(room=room, reason=reason):
                r = self.loads.get(room)
                if r is not None and r.phase is Phase.ASKING:
                    self._end(r, f"no producer: {reason}")

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
        now = time.monotonic()
        r = self.loads[room] = Loading(load, now + self.settings.load_s, started=now)
        dst = to_wire(self.groups, load.block_ids)
        ask = TransferRequest(room, self.epoch, load.first_token + load.num_tokens, indices_to_wire(dst), [])
        self._lookups.submit(self._introduce, load.remote, r.deadline, ask)

    def _release(self, rel: Release) -> None:
        room = rel.remote.room
        r = self.loads.get(room)
        if r is None or rel.req_id is None or r.load.req_id != rel.req_id:
            if rel.req_id is None:  # never loaded: the producer still holds the room
                deadline = time.monotonic() + self.settings.load_s
                self._lookups.submit(self._introduce, rel.remote, deadline, Abort(room, rel.reason))
            return
        r.release = rel.reason
        if r.endpoint is not None:
            self.io.send(r.endpoint, Abort(room, rel.reason))

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
                if r is not None and r.endpoint in (None, endpoint) and r.phase is not Phase.QUARANTINED:
                    r.phase, r.endpoint = Phase.TRANSFERRING, endpoint
            case TransferDone():
                self._done(endpoint, msg)

    def _done(self, endpoint: str, msg: TransferDone) -> None:
        r = self.loads.get(msg.room)
        if r is None or r.endpoint not in (None, endpoint):
            return
        if msg.ok and r.phase is not Phase.QUARANTINED:
            self._end(r, "", msg.report.nbytes if msg.report is not None else 0)
        elif msg.settled:
            self._end(r, msg.reason or "producer gave up")
        elif r.phase is not Phase.QUARANTINED:  # writes of its may still land in the blocks: not yet
            log.warning(
                "room %d: %s; writes may still land: holding its blocks up to %g s",
                msg.room,
                msg.reason,
                self.settings.quarantine_s,
            )
            r.phase, r.endpoint = Phase.QUARANTINED, endpoint
            r.deadline = time.monotonic() + self.settings.quarantine_s

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
                self._end(r, f"the producer's writes did not settle within {self.settings.quarantine_s:g} s")
                continue
            if r.endpoint is not None:
                self.io.send(r.endpoint, Abort(r.load.remote.room, "the consumer's load deadline passed"))
            self._end(r, f"load deadline of {self.settings.load_s:g} s passed ({r.phase.value})")

    def _beat(self) -> None:
        for endpoint in self.peers.silent():
            self._peer_lost(endpoint, f"producer {endpoint} silent for {self.settings.dead_after_s:g} s")
        for endpoint in self.peers.abandoned():  # its registration failed
            self.io.drop(endpoint)
        for endpoint in self.peers.registered_endpoints():
            self.io.reply(endpoint, Heartbeat(self.epoch))

    def _peer_lost(self, endpoint: str, reason: str) -> None:
        """Fail the loads from this producer (it is gone: nothing of its lands any more)."""
        self.peers.lost(endpoint)
        self.io.drop(endpoint)
        for r in [r for r in self.loads.values() if r.endpoint == endpoint]:
            self._end(r, reason)

    # ---- a lookup thread ---------------------------------------------------------------------
    def _introduce(self, remote: RemotePrefill, deadline: float, msg: TransferRequest | Abort) -> None:
        """Find the producer rank that holds our heads of `remote.room` (registering with it
        if new) and send it `msg`; the loop hears where (or why not)."""
        try:
            [peer] = self.introducer.senders(remote.bootstrap, deadline)
        except (DisaggError, ValueError) as exc:
            if isinstance(msg, TransferRequest):
                self.handoff.post(IntroFailed(remote.room, str(exc)))
            else:
                log.warning("room %d: could not tell its producer to let go (%s)", remote.room, exc)
            return
        self.io.send(peer.endpoint, msg)
        if isinstance(msg, TransferRequest):
            self.handoff.post(Introduced(remote.room, peer.endpoint))

    def wake(self) -> None:
        """From vLLM's thread, after posting a step to the Handoff: the loop takes it now."""
        self.io.wake()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._lookups.shutdown(wait=True, cancel_futures=True)
        self.io.close()
