"""One write through the Mooncake engine (mooncake.py says why it works this way): its ranges
submitted one single-entry batch each, as the peer's budget of ranges in flight allows, and
retired in order with sleeps between polls (never Mooncake's spinning batch waits); a write
prepared ahead holds its addresses until start().

    prepare: (region, offset) -> addresses, checked     start: MooncakeWrite submits what the
    poll / wait: retire landed ranges (budget back),           budget grants now, the rest as
                 submit more; the first failure stops           earlier ranges retire
                 submitting, drains, then raises
"""

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from transfer.errors import WriteFailed, WritesAbandoned
from transfer.transports.base import PendingWrite, PreparedWrite

if TYPE_CHECKING:
    from transfer.transports.mooncake import MooncakeLink


class PeerBudget:
    """Counts ranges in flight to one peer, across threads."""

    def __init__(self, limit: int):
        self.limit, self.inflight = limit, 0
        self._lock = threading.Lock()

    def try_acquire(self, n: int) -> int:
        """Take up to `n` units; returns how many were granted (maybe 0)."""
        with self._lock:
            granted = max(0, min(n, self.limit - self.inflight))
            self.inflight += granted
            return granted

    def release(self, n: int) -> None:
        with self._lock:
            self.inflight -= n


class MooncakeWrite(PendingWrite):
    """Ranges submitted one engine batch each as the peer's budget allows, retired in order.
    On the first failure it stops submitting, drains what is in flight, then raises."""

    POLL_INTERVAL_S = 100e-6

    def __init__(self, te, session: str, budget: PeerBudget, src: np.ndarray, dst: np.ndarray, length: np.ndarray):
        self._te, self.peer, self._budget = te, session, budget
        self._src, self._dst, self._len = src.tolist(), dst.tolist(), length.tolist()
        self.nbytes = int(length.sum()) if len(length) else 0
        self._next = 0                        # next range to submit
        self._inflight: deque[int] = deque()  # batch ids, in submission order
        self._failure: tuple[int, str] | None = None
        self._lock = threading.Lock()         # the owner's polls and the reaper's
        self._abandoned = False
        self.pump()

    @property
    def ended(self) -> bool:
        """Nothing of this write is in the engine any more (landed, failed or never submitted)."""
        return not self._inflight and (self._abandoned or self._failure is not None or self._next >= len(self._src))

    def abandon(self) -> None:
        """The peer is gone: submit nothing more; waiters get WritesAbandoned at once."""
        with self._lock:
            self._abandoned = True

    def pump(self) -> None:
        """Retire what ended (returning budget), then submit what the budget allows."""
        with self._lock:
            self._pump_locked()

    def _pump_locked(self) -> None:
        te = self._te
        while self._inflight:  # retire finished ranges in submission order
            code = te.transfer_check_status(self._inflight[0])
            if code == 0:
                break
            self._inflight.popleft()
            self._budget.release(1)
            if code != 1 and self._failure is None:
                self._failure = (code, "timed out" if code == -2 else "failed")
        if self._abandoned or self._failure is not None or self._next >= len(self._src):
            return
        granted = self._budget.try_acquire(len(self._src) - self._next)
        used = 0
        while used < granted:
            i = self._next
            batch = te.transfer_submit_write(self.peer, self._src[i], self._dst[i], self._len[i])
            self._next += 1
            used += 1
            if batch <= 0:  # refused at submission (dead session, unknown peer)
                self._failure = (int(batch), "was refused")
                self._budget.release(1)
                break
            self._inflight.append(batch)
        self._budget.release(granted - used)

    def poll(self) -> bool:
        if self._abandoned:
            raise WritesAbandoned("write", -1, self.peer, self.nbytes,
                                  detail="the link was closed (peer lost or re-registered); the write was abandoned")
        self.pump()
        if self._inflight or (self._failure is None and self._next < len(self._src)):
            return False
        if self._failure is not None:
            code, what = self._failure
            raise WriteFailed("write", code, self.peer, self.nbytes, detail=f"a range {what}")
        return True

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.poll():
            if deadline is not None and time.monotonic() > deadline:
                raise WriteFailed("write", -2, self.peer, self.nbytes, detail=f"not done within {timeout} s")
            time.sleep(self.POLL_INTERVAL_S)


class MooncakePrepared(PreparedWrite):
    """Ranges checked and turned into addresses; start() submits them."""

    def __init__(self, link: "MooncakeLink", src: np.ndarray, dst: np.ndarray, length: np.ndarray):
        self._link, self._args = link, (src, dst, length)
        self.nbytes = int(length.sum()) if len(length) else 0

    def start(self) -> MooncakeWrite:
        if self._args is None:
            raise RuntimeError("a prepared write starts once")
        args, self._args = self._args, None
        return self._link._start(*args)
