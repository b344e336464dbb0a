"""Admission: bounded waiting for pool space, so a full pool means "wait a little, then a clear
refusal", never a deadlock or an unbounded queue.

    alloc() --ok--> RequestKV
       | OutOfSpace
       +-- larger than the whole pool ---------------> TooLarge      (never fits: HTTP 400)
       +-- `max_waiting` already waiting ------------> Overloaded    (HTTP 503, at once)
       +-- wait for a free (released()), retry, until `wait_s` or the caller's deadline
                                              +-----> Overloaded    (HTTP 503, pool full)
"""

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvpool.errors import OutOfSpace
from disagg.errors import Overloaded, TooLarge

T = TypeVar("T")


class Admission:
    def __init__(self, shortfall: Callable[..., str | None], max_waiting: int, wait_s: float):
        """`shortfall(num_tokens, grow_to=None)`: why a request of that size (growing to
        grow_to tokens) can never fit the empty pool, naming the component that is short; None
        when it fits."""
        if max_waiting < 0 or wait_s < 0:
            raise ValueError("max_waiting and wait_s must be >= 0")
        self.shortfall, self.max_waiting, self.wait_s = shortfall, max_waiting, wait_s
        self._freed = threading.Condition()
        self._generation = 0  # bumped on every release: waiters retry only after one
        self.waiting = 0

    def admit(
        self, num_tokens: int, alloc: Callable[[], T], deadline: float | None = None, grow_to: int | None = None
    ) -> T:
        """alloc(), waiting for frees while the pool is full. `deadline` is a monotonic time;
        `grow_to`: the most tokens the request will hold (decode: prompt + new tokens)."""
        why = self.shortfall(num_tokens, grow_to=grow_to)
        if why is not None:
            grows = f" growing to {grow_to}" if grow_to and grow_to > num_tokens else ""
            raise TooLarge(f"a request of {num_tokens} tokens{grows} does not fit in this pool: {why}")
        give_up = time.monotonic() + self.wait_s
        if deadline is not None:
            give_up = min(give_up, deadline)
        with self._freed:
            seen = self._generation
        try:
            return alloc()
        except OutOfSpace as exc:
            full = exc
        with self._freed:
            if self.waiting >= self.max_waiting:
                raise Overloaded(f"pool full ({full}) and {self.waiting} requests already waiting")
            self.waiting += 1
        try:
            while True:
                with self._freed:
                    left = give_up - time.monotonic()
                    if left <= 0 or not self._freed.wait_for(lambda: self._generation != seen, left):
                        raise Overloaded(f"pool full for {self.wait_s:g} s: {full}")
                    seen = self._generation
                try:
                    return alloc()
                except OutOfSpace as exc:
                    full = exc
        finally:
            with self._freed:
                self.waiting -= 1

    def released(self) -> None:
        """Call after freeing pool space: waiting requests try again."""
        with self._freed:
            self._generation += 1
            self._freed.notify_all()
