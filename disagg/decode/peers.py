"""The prefill peers of one decode: bootstrap lookups (cached until the peer is lost or its
registration fails), one registration per prefill epoch, and liveness. Request threads look
peers up and wait for their registration; the loop thread records answers and heartbeats and
drops silent peers (under one lock).

A registration's life (one PrefillPeer per prefill epoch; every request that needs that
epoch waits on the same one):

    SENT --Registered--> ACCEPTED
      |  --Refused-----> REFUSED       (final: its reason goes to every waiter)
      +--no answer by answer_by (dead_after_s after it was sent)--> UNANSWERED
                                       (every waiter wakes: each looks the rank up again,
                                        since the bootstrap may name the prefill's successor)
"""

import threading
import time
from dataclasses import dataclass, field
from enum import Enum, auto

from disagg.bootstrap.server import BootstrapClient
from disagg.control.auth import Gate
from disagg.control.liveness import Liveness
from disagg.control.layout import LayoutInfo, layout_difference
from disagg.control.messages import PROTOCOL_VERSION, RegisterPrefill
from disagg.errors import ProtocolError, Unanswered


class Registration(Enum):
    SENT = auto()  # RegisterDecode sent, no answer yet
    ACCEPTED = auto()
    REFUSED = auto()  # prefill said no (`why`)
    UNANSWERED = auto()  # no answer by `answer_by`: given up on


@dataclass(eq=False)
class PrefillPeer:
    info: RegisterPrefill
    answer_by: float  # monotonic: a registration unanswered by then is given up
    phase: Registration = Registration.SENT
    why: str = ""  # REFUSED: prefill's reason
    settled: threading.Event = field(default_factory=threading.Event)  # left SENT
    epoch: int = 0
    transport: str = ""  # the transport prefill picked for us
    may_stage: bool = True  # False: it said it never sends us staged (lend it no slots)

    @property
    def endpoint(self) -> str:
        return self.info.control_endpoint


class PrefillPeers:
    def __init__(self, gate: Gate, layout: LayoutInfo, dead_after_s: float):
        self._gate, self.layout = gate, layout
        self._answer_s = dead_after_s  # a prefill silent this long after our registration is lost
        self._lock = threading.Lock()
        self._peers: dict[str, PrefillPeer] = {}  # control endpoint -> peer
        self._lookups: dict[tuple[str, int], RegisterPrefill] = {}
        self._checked: set[tuple[str, int]] = set()  # lookups whose layout matched ours
        self._liveness = Liveness(dead_after_s)  # registered peers only
        self._abandoned: set[str] = set()  # registration failed: close the socket

    # ---- request threads ---------------------------------------------------------------------
    def lookup(self, bootstrap: str, deadline: float, tp_rank: int = 0, check_layout: bool = True) -> RegisterPrefill:
        """Prefill rank `tp_rank` as the bootstrap names it (cached until the peer is lost);
        ProtocolError if its layout differs from ours (unless `check_layout` is off)."""
        with self._lock:
            info = self._lookups.get((bootstrap, tp_rank))
        if info is None:
            client = BootstrapClient(bootstrap, self._gate, max(0.05, deadline - time.monotonic()))
            try:
                info = client.lookup(PROTOCOL_VERSION, tp_rank)
            finally:
                client.close()
            if info.tp_rank != tp_rank:
                raise ProtocolError(
                    f"bootstrap {bootstrap} answered for prefill rank {tp_rank} with rank {info.tp_rank}"
                )
            with self._lock:
                self._lookups[(bootstrap, tp_rank)] = info
        if not check_layout:
            return info
        diff = layout_difference(prefill=info.layout, decode=self.layout)
        if diff:
            raise ProtocolError(f"prefill layout differs: {diff}")
        with self._lock:
            if self._lookups.get((bootstrap, tp_rank)) is info:
                self._checked.add((bootstrap, tp_rank))
        return info

    def known(self, bootstrap: str, tp_rank: int = 0) -> RegisterPrefill | None:
        """Prefill rank `tp_rank` as the bootstrap named it before, its layout checked against
        ours (None: not looked up and checked, or forgotten since); never waits."""
        with self._lock:
            key = (bootstrap, tp_rank)
            return self._lookups.get(key) if key in self._checked else None

    def ready(self, info: RegisterPrefill) -> PrefillPeer | None:
        """The peer `info` names if it accepted our registration at its epoch and is not lost
        (None: register, or wait for its answer, through join and wait_registered); never waits."""
        with self._lock:
            peer = self._peers.get(info.control_endpoint)
            ok = peer is not None and peer.info.epoch == info.epoch and self._liveness.known(info.control_endpoint)
            return peer if ok and peer.phase is Registration.ACCEPTED else None

    def join(self, info: RegisterPrefill) -> tuple[PrefillPeer, bool]:
        """The peer a lookup named and whether it is new (then the caller registers)."""
        with self._lock:
            peer = self._peers.get(info.control_endpoint)
            fresh = peer is None or peer.info.epoch != info.epoch
            if fresh:
                peer = PrefillPeer(info, time.monotonic() + self._answer_s)
                self._peers[info.control_endpoint] = peer
            return peer, fresh

    def wait_registered(self, peer: PrefillPeer, deadline: float) -> PrefillPeer:
        """The peer once it accepted our registration. Refused, or unanswered by its
        `answer_by`, it is forgotten with its lookups (the next look asks the bootstrap again:
        it may name another prefill by then), its socket left to the loop thread to close
        (`abandoned`), and every request waiting on it wakes: Unanswered (look it up again)
        or ProtocolError (refused, or our own deadline came first)."""
        if not peer.settled.wait(max(0.0, min(deadline, peer.answer_by) - time.monotonic())):
            if time.monotonic() < peer.answer_by:  # our deadline, not the registration's
                raise ProtocolError(f"prefill {peer.endpoint} did not answer the registration within the deadline")
            self._settle(peer, Registration.UNANSWERED)
        if peer.phase is Registration.UNANSWERED:
            raise Unanswered(
                f"prefill {peer.endpoint} did not answer the registration in {self._answer_s:g} s "
                "(the next look asks the bootstrap again)"
            )
        if peer.phase is Registration.REFUSED:
            self._abandon(peer)
            raise ProtocolError(f"prefill refused registration: {peer.why}")
        return peer

    def _settle(self, peer: PrefillPeer, phase: Registration, why: str = "") -> bool:
        """Move a SENT registration to `phase` and wake its waiters (False: it had left SENT)."""
        with self._lock:
            if peer.phase is not Registration.SENT:
                return False
            peer.phase, peer.why = phase, why
        if phase is Registration.UNANSWERED:
            self._abandon(peer)
        peer.settled.set()
        return True

    def _abandon(self, peer: PrefillPeer) -> None:
        with self._lock:
            if self._peers.get(peer.endpoint) is not peer:  # another request got there first
                return
            self._forget(peer.endpoint)
            self._abandoned.add(peer.endpoint)

    # ---- the loop thread ---------------------------------------------------------------------
    def registered(self, endpoint: str, epoch: int, transport: str, may_stage: bool = True) -> None:
        with self._lock:
            peer = self._peers.get(endpoint)
            if peer is None or peer.phase is not Registration.SENT:
                return
            peer.epoch, peer.transport, peer.may_stage = epoch, transport, may_stage
            self._liveness.heard(endpoint)
        self._settle(peer, Registration.ACCEPTED)

    def refused(self, endpoint: str, reason: str) -> bool:
        """A Refused from `endpoint`: the answer to our registration (False), or, once
        registered, the peer dropped us (True: the caller treats it as lost)."""
        with self._lock:
            peer = self._peers.get(endpoint)
            if peer is None:
                return False
            if peer.phase is Registration.ACCEPTED:
                return True
        self._settle(peer, Registration.REFUSED, reason)
        return False

    def heard(self, endpoint: str) -> None:
        with self._lock:
            if self._liveness.known(endpoint):
                self._liveness.heard(endpoint)

    def silent(self) -> list[str]:
        with self._lock:
            return list(self._liveness.silent())

    def registered_endpoints(self) -> list[str]:
        with self._lock:
            return [e for e in self._peers if self._liveness.known(e)]

    def abandoned(self) -> list[str]:
        """(Loop thread.) Endpoints whose registration failed and that no request has joined
        since: their sockets are to be closed (a later registration connects afresh)."""
        with self._lock:
            gone = [e for e in self._abandoned if e not in self._peers]
            self._abandoned.clear()
            return gone

    def lost(self, endpoint: str) -> None:
        """Forget the peer and its lookups: the next request looks it up and registers again."""
        with self._lock:
            self._forget(endpoint)

    def _forget(self, endpoint: str) -> None:
        """(Under the lock.)"""
        self._peers.pop(endpoint, None)
        self._liveness.forget(endpoint)
        for key in [k for k, info in self._lookups.items() if info.control_endpoint == endpoint]:
            del self._lookups[key]
            self._checked.discard(key)
