"""How a decode meets the prefill ranks behind a bootstrap: look them up (the ranks that hold
some of our heads), register with each new one (once per prefill epoch) and wait for its
answer. Every request goes through it; so does `ReadinessWatch`, which introduces decode to
its default bootstrap's prefill at start-up and again whenever that prefill changes (a
restart drops the peer, and the next look registers afresh), so a decode paired with the
wrong model is unready with the difference as its reason before any request is sent.

    request thread / watch --senders()--> PrefillPeers.lookup (bootstrap, cached)
                                      --> RegisterDecode to each new rank (loop thread sends)
                                      --> PrefillPeers.wait_registered (answer or refusal)
                                      <-- Unanswered: again from the lookup, while the
                                          deadline lasts (a rank that died after the
                                          lookup named it; the bootstrap may name its
                                          successor now)
"""

import logging
import threading
import time
from collections.abc import Callable

from disagg.control.io import DealerIO
from disagg.control.messages import RegisterDecode
from disagg.decode.instances import SenderRanks
from disagg.decode.peers import PrefillPeer, PrefillPeers
from disagg.errors import DisaggError, ProtocolError, Unanswered

log = logging.getLogger(__name__)


class Introducer:
    def __init__(
        self, peers: PrefillPeers, instances: SenderRanks, io: DealerIO, registration: Callable[[], RegisterDecode]
    ):
        self.peers, self.instances, self.io, self.registration = peers, instances, io, registration

    def senders(self, bootstrap: str, deadline: float, check_layout: bool = True) -> list[PrefillPeer]:
        """The registered prefill ranks behind `bootstrap` that hold some of our heads (one if
        the instances' TP sizes are equal: our rank). `check_layout=False` registers even
        with a prefill whose layout the lookup shows to differ: prefill refuses it in the
        same words and logs the refusal, so both sides' operators see it. A registration
        unanswered in time (PrefillPeers.wait_registered) starts over from the lookup."""
        while True:
            try:
                return self._introduce(bootstrap, deadline, check_layout)
            except Unanswered as exc:
                if time.monotonic() >= deadline:
                    raise
                log.info("%s; looking prefill up again at %s", exc, bootstrap)

    def _introduce(self, bootstrap: str, deadline: float, check_layout: bool) -> list[PrefillPeer]:
        first = self.peers.lookup(bootstrap, deadline, 0, check_layout)
        peers = []
        for rank in self.instances.sender_ranks(first):
            info = first if rank == 0 else self.peers.lookup(bootstrap, deadline, rank, check_layout)
            if info.tp_size != first.tp_size:
                raise ProtocolError(
                    f"prefill ranks behind {bootstrap} disagree on their TP size (rank 0: "
                    f"{first.tp_size}, rank {rank}: {info.tp_size}): an instance is restarting"
                )
            peer, fresh = self.peers.join(info)
            if fresh:
                self.io.send(peer.endpoint, self.registration(), connect=True)
            peers.append(peer)
        return [self.peers.wait_registered(peer, deadline) for peer in peers]

    def known(self, bootstrap: str) -> list[PrefillPeer] | None:
        """What senders() answers when every rank it needs was looked up and registered with
        before (the same layout check), without waiting: a request's common case, taken where
        it arrives. None when any rank is not (then senders(), on a thread that may wait)."""
        first = self.peers.known(bootstrap)
        if first is None:
            return None
        try:
            ranks = self.instances.sender_ranks(first)
        except ProtocolError:
            return None  # senders() says why
        peers = []
        for rank in ranks:
            info = first if rank == 0 else self.peers.known(bootstrap, rank)
            peer = self.peers.ready(info) if info is not None and info.tp_size == first.tp_size else None
            if peer is None:
                return None
            peers.append(peer)
        return peers


class ReadinessWatch:
    """/ready from state kept up to date on a thread of its own: never waits on the network
    when asked. Introduces decode to `bootstrap`'s prefill every `every_s` (a no-op while the
    registration holds)."""

    def __init__(self, introducer: Introducer, bootstrap: str, timeout_s: float, every_s: float = 1.0):
        self.introducer, self.bootstrap, self.timeout_s, self.every_s = introducer, bootstrap, timeout_s, every_s
        self._state = {
            "ready": False,
            "bootstrap": bootstrap,
            "why": f"starting: introducing this decode to the prefill behind its --bootstrap-addr {bootstrap}",
        }
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="decode-ready", daemon=True)

    def start(self) -> "ReadinessWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.timeout_s + 1)

    def state(self) -> dict:
        return dict(self._state)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def check(self) -> dict:
        """One introduction (what the thread does every `every_s`); the new state."""
        try:
            peers = self.introducer.senders(self.bootstrap, time.monotonic() + self.timeout_s, check_layout=False)
            state = {"ready": True, "bootstrap": self.bootstrap, "prefill": [p.endpoint for p in peers]}
        except DisaggError as exc:
            state = {
                "ready": False,
                "bootstrap": self.bootstrap,
                "why": f"{exc} (prefill behind this decode's --bootstrap-addr {self.bootstrap})",
            }
        if state["ready"] != self._state.get("ready") or state.get("why") != self._state.get("why"):
            (log.info if state["ready"] else log.warning)(
                "ready: %s" if state["ready"] else "not ready: %s", state.get("prefill") or state["why"]
            )
        self._state = state
        return state

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # a bug here must not end the watch
                log.exception("readiness check failed")
            self._stop.wait(self.every_s)
