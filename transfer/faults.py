"""Fault injection: named points in the KV manager and the servers where a failure can be
made to happen on purpose, with a probability each, to test that every failure path frees
what it holds and never passes off bad bytes as good.

    --inject-faults send.write=0.02,recv.chunk=0.01,control.drop_done=0.01 --fault-seed 7

Off by default (an empty plan costs one dict lookup per point).
"""

import random
import threading
from dataclasses import dataclass, field

from transfer.errors import InjectedFault

POINTS = {
    "prefill.compute": "prefill: computing the prompt's KV fails",
    "send.write": "prefill: a transport write fails (body, staged chunk or AUX, or a body chained with its AUX "
    "row on an ordered link; earlier writes landed)",
    "control.drop_done": "prefill: a TransferDone is lost on the way to decode",
    "send.stall": "prefill: once a send's body writes are out (some may have landed), the sender stops there for "
    "good, as a producer stopped or dying mid-transfer does (tests kill it there: it logs "
    "'injected fault at send.stall')",
    "decode.alloc": "decode: allocating the destination fails",
    "recv.chunk": "decode: scattering a staged chunk fails",
    "prefill.flip": "prefill: one byte of the KV it computed is flipped before it is digested and sent (only "
    "the colocated check, --check-rate, can tell)",
    "decode.flip": "decode: one byte of the KV that arrived is flipped before it is verified, one no decode step "
    "reads where there is one (verification must fail the request)",
}


@dataclass(frozen=True)
class FaultPlan:
    rates: dict[str, float] = field(default_factory=dict)  # point -> probability per pass
    seed: int | None = None

    def __post_init__(self) -> None:
        for point, rate in self.rates.items():
            if point not in POINTS:
                raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"fault rate for {point} must be in [0, 1], got {rate}")

    @staticmethod
    def parse(text: str, seed: int | None = None) -> "FaultPlan":
        """'point=rate,point=rate' ('' for none)."""
        rates = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            point, sep, rate = item.partition("=")
            if not sep:
                raise ValueError(f"fault spec {item!r} is not point=rate")
            try:
                rates[point.strip()] = float(rate)
            except ValueError:
                raise ValueError(f"fault rate {rate!r} for {point} is not a number") from None
        return FaultPlan(rates, seed)


class FaultInjector:
    def __init__(self, plan: FaultPlan | None = None):
        self.plan = plan or FaultPlan()
        self._rng = random.Random(self.plan.seed)
        self._lock = threading.Lock()
        self.fired: dict[str, int] = {}

    def hit(self, point: str) -> bool:
        """Whether the fault at `point` happens this time."""
        rate = self.plan.rates.get(point)
        if not rate:
            return False
        with self._lock:
            if self._rng.random() >= rate:
                return False
            self.fired[point] = self.fired.get(point, 0) + 1
        return True

    def check(self, point: str) -> None:
        """Raise InjectedFault if the fault at `point` happens this time."""
        if self.hit(point):
            raise InjectedFault(f"injected fault at {point}")
