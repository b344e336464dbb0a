"""Per-request transfer state on either side. Transitions only go forward:

    BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS
          \\______________\\___________________\\_______-> FAILED(reason)

SUCCESS and FAILED are terminal. poll() is one attribute read; wait() blocks on an event.
A state belongs to exactly one room: complete() refuses a different room, so a completion
message meant for another request can never be taken for this one.
"""

import threading
from enum import IntEnum

from transfer.errors import ProtocolError


class KVPoll(IntEnum):
    BOOTSTRAPPING = 0
    WAITING_FOR_INPUT = 1
    TRANSFERRING = 2
    SUCCESS = 3
    FAILED = 4

    @property
    def terminal(self) -> bool:
        return self >= KVPoll.SUCCESS


class InvalidTransition(ProtocolError):
    pass


class TransferState:
    def __init__(self, room: int):
        self.room = room
        self._state = KVPoll.BOOTSTRAPPING
        self.reason = ""
        self._lock = threading.Lock()
        self._done = threading.Event()

    def poll(self) -> KVPoll:
        return self._state

    def advance(self, to: KVPoll) -> None:
        """Move forward to a non-terminal state; backwards or out of a terminal state raises."""
        if to.terminal:
            raise InvalidTransition(f"room {self.room}: use complete() or fail() to end a transfer")
        with self._lock:
            if self._state.terminal or to <= self._state:
                raise InvalidTransition(f"room {self.room}: {self._state.name} -> {to.name} is not forward")
            self._state = to

    def complete(self, room: int) -> None:
        """SUCCESS, for this room only, and only from TRANSFERRING."""
        if room != self.room:
            raise InvalidTransition(f"completion for room {room} offered to room {self.room}")
        with self._lock:
            if self._state is not KVPoll.TRANSFERRING:
                raise InvalidTransition(f"room {self.room}: SUCCESS from {self._state.name}")
            self._state = KVPoll.SUCCESS
        self._done.set()

    def fail(self, reason: str) -> bool:
        """FAILED(reason) unless already terminal; returns whether this call ended it."""
        with self._lock:
            if self._state.terminal:
                return False
            self._state = KVPoll.FAILED
            self.reason = reason
        self._done.set()
        return True

    def wait(self, timeout: float | None = None) -> KVPoll:
        self._done.wait(timeout)
        return self._state
