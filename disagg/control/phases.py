"""Per-request transfer state on either side, and the deadline of each phase. Transitions only
go forward:

    BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS
          \\______________\\___________________\\_______-> FAILED(reason)

SUCCESS and FAILED are terminal. poll() is one attribute read; wait() blocks on a condition.
A state belongs to exactly one room: complete() refuses a different room, so a completion
message meant for another request can never be taken for this one.

What each phase waits for (each bounded by its own deadline, counted from entering it):

    phase               prefill                                decode
    BOOTSTRAPPING       decode's TransferRequest for the room  lookup, registration, admission
    WAITING_FOR_INPUT   its own KV computed                    prefill's TransferStarted
    TRANSFERRING        the send                               prefill's TransferDone
"""

import threading
import time
from dataclasses import dataclass
from enum import IntEnum

from disagg.errors import InvalidTransition


class KVPoll(IntEnum):
    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def terminal(self) -> bool:
        return self >= KVPoll.SUCCESS


@dataclass(frozen=True)
class Deadlines:
    """Seconds each phase may last; defaults suit interactive serving."""
    bootstrap_s: float = 10.0
    waiting_s: float = 30.0
    transfer_s: float = 30.0

    def __post_init__(self) -> None:
        for name in ("bootstrap_s", "waiting_s", "transfer_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"deadline {name} must be > 0")

    def of(self, phase: KVPoll) -> float:
        return (self.bootstrap_s, self.waiting_s, self.transfer_s)[phase]


class TransferState:
    def __init__(self, room: int):
        self.room = room
        self._state = KVPoll.BOOTSTRAPPING
        self._since = time.monotonic()   # when the current phase began
        self.reason = ""
        self._changed = threading.Condition()

    def poll(self) -> KVPoll:
        return self._state

    def advance(self, to: KVPoll) -> None:
        """Move forward to a non-terminal state; backwards or out of a terminal state raises."""
        if to.terminal:
            raise InvalidTransition(f"room {self.room}: use complete() or fail() to end a transfer")
        with self._changed:
            if self._state.terminal or to <= self._state:
                raise InvalidTransition(f"room {self.room}: {self._state.name} -> {to.name} is not forward")
            self._state, self._since = to, time.monotonic()
            self._changed.notify_all()

    def complete(self, room: int) -> None:
        """SUCCESS, for this room only, and only from TRANSFERRING."""
        if room != self.room:
            raise InvalidTransition(f"completion for room {room} offered to room {self.room}")
        with self._changed:
            if self._state is not KVPoll.TRANSFERRING:
                raise InvalidTransition(f"room {self.room}: SUCCESS from {self._state.name}")
            self._state = KVPoll.SUCCESS
            self._changed.notify_all()

    def fail(self, reason: str) -> bool:
        """FAILED(reason) unless already terminal; returns whether this call ended it."""
        with self._changed:
            if self._state.terminal:
                return False
            self._state, self.reason = KVPoll.FAILED, reason
            self._changed.notify_all()
        return True

    def wait(self, timeout: float | None = None) -> KVPoll:
        with self._changed:
            self._changed.wait_for(lambda: self._state.terminal, timeout)
            return self._state

    def wait_phased(self, deadlines: Deadlines, side: str) -> KVPoll:
        """Wait for a terminal state; fail the request when a phase outlives its deadline."""
        with self._changed:
            while not self._state.terminal:
                phase, limit = self._state, deadlines.of(self._state)
                left = self._since + limit - time.monotonic()
                if left <= 0:
                    self._state = KVPoll.FAILED
                    self.reason = f"{side}: {phase.name} deadline of {limit:g} s passed ({_WAITING_FOR[side][phase]})"
                    self._changed.notify_all()
                    break
                self._changed.wait(left)
            return self._state


_WAITING_FOR = {
    "prefill": {KVPoll.BOOTSTRAPPING: "no TransferRequest from decode", KVPoll.WAITING_FOR_INPUT: "KV not computed",
                KVPoll.TRANSFERRING: "send not finished"},
    "decode": {KVPoll.BOOTSTRAPPING: "no prefill registration or pool space", KVPoll.WAITING_FOR_INPUT:
               "prefill never started the transfer", KVPoll.TRANSFERRING: "no TransferDone from prefill"},
}
