"""The bookkeeping of staged transfers: staging slots leased per transfer (SlotLease) and
which chunks the receiver acknowledged (AckLedger). Both thread-safe; neither touches bytes."""

import threading

from transfer.errors import AckTimeout, StagingError


class SlotLease:
    """Thread-safe pool of slot numbers: a transfer takes some and gives them back."""

    def __init__(self, num_slots: int):
        self._free = list(range(num_slots))
        self._cond = threading.Condition()

    def acquire(self, n: int, timeout: float | None = 0.0) -> list[int]:
        """Up to `n` slots (at least one); [] if none frees up within `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout=timeout):
                return []
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def take(self, n: int, timeout: float) -> list[int]:
        """Exactly `n` slots, waiting up to `timeout` seconds for that many to be free; [] if
        they are not (all or nothing: a caller never holds some while waiting for more)."""
        with self._cond:
            if n < 1 or not self._cond.wait_for(lambda: len(self._free) >= n, timeout=max(0.0, timeout)):
                return []
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def release(self, slots: list[int]) -> None:
        with self._cond:
            if set(slots) & set(self._free):
                raise StagingError(f"slots {sorted(set(slots) & set(self._free))} released twice")
            self._free.extend(slots)
            self._cond.notify_all()

    def available(self) -> int:
        with self._cond:
            return len(self._free)


class AckLedger:
    """Which chunks of which transfers a sender notified and which the receiver acknowledged
    (thread-safe). Every ChunkChannel keeps one: an ack for an unknown transfer or an unsent
    chunk is dropped, never counted."""

    def __init__(self) -> None:
        self._sent: dict[int, int] = {}  # transfer id -> chunks notified
        self._done: dict[int, int] = {}  # transfer id -> highest chunk acknowledged
        self._cond = threading.Condition()

    def sent(self, transfer_id: int, index: int) -> None:
        with self._cond:
            self._sent[transfer_id] = max(self._sent.get(transfer_id, 0), index + 1)

    def acked(self, transfer_id: int, index: int) -> bool:
        """Record an ack; False (and nothing recorded) unless that chunk was sent."""
        with self._cond:
            if index >= self._sent.get(transfer_id, 0):
                return False
            self._done[transfer_id] = max(index, self._done.get(transfer_id, -1))
            self._cond.notify_all()
            return True

    def done(self, transfer_id: int, index: int) -> bool:
        with self._cond:
            return self._done.get(transfer_id, -1) >= index

    def knows(self, transfer_id: int) -> bool:
        with self._cond:
            return transfer_id in self._sent

    def wait(self, transfer_id: int, index: int, timeout: float) -> None:
        """Block until chunk `index` (and every earlier one) is acknowledged, else AckTimeout."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done.get(transfer_id, -1) >= index, timeout=timeout):
                raise AckTimeout(f"transfer {transfer_id}: no ack for chunk {index} within {timeout} s")

    def end(self, transfer_id: int) -> None:
        with self._cond:
            self._sent.pop(transfer_id, None)
            self._done.pop(transfer_id, None)
