"""A prefill request's record and its one phase enum (moved only by prefill/requests.py's
RequestTable, under its lock): which phases end it, which deadline each has, and in which a
transfer worker may be writing."""

import time
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from disagg.control.deadlines import Deadlines
from disagg.prefill.destinations import Destination
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
    src: IndexSet | None = None           # its pages' indices while computed (sends are planned then)
    dests: dict[int, Destination] = field(default_factory=dict)   # decode rank -> where its share goes
    receivers: frozenset[int] | None = None   # the decode ranks to expect (from the first one's TP size)
    tp_size: int = 0                      # the decode instance's TP size
    reason: str = ""
    timings: dict = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    progress: LayerProgress | None = None   # streamed: which layers the engine has finished
    computing: bool = False   # streamed: the engine still writes the pages the table holds
    streamed: bool = False    # a worker started while the engine computed
    stream_auto: bool = False # streams by `auto`: only over a link that leaves the compute alone
    settled: bool = True      # False: its writes were abandoned in flight (peer lost): decode is
                              # told so, and keeps the pages until the cap (TransferDone.settled)

    @property
    def complete(self) -> bool:
        """Every destination this request expects is here."""
        return self.receivers is not None and self.receivers == self.dests.keys()

    @property
    def writers(self) -> int:
        return sum(d.writing for d in self.dests.values())

    def peers(self) -> set[bytes]:
        return {d.peer for d in self.dests.values()}


MISSING = {Phase.AWAITING_DECODE: "no TransferRequest from decode", Phase.ORPHANED: "the prompt never came",
            Phase.COMPUTING: "KV not computed", Phase.STREAMING: "KV not computed",
            Phase.TRANSFERRING: "send not finished"}
