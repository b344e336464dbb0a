"""ChunkRelay: the staged-transfer ChunkChannel carried over the control plane.

The prefill side sends ChunkLanded through its outbox and waits here for the ChunkDone
acks that its I/O thread delivers with on_done()."""

import threading

from disagg.control.messages import ChunkLanded, encoder
from disagg.control.outbox import Outbox
from transfer.errors import AckTimeout
from transfer.staging import Piece


class ChunkRelay:
    def __init__(self, outbox: Outbox, identity: bytes):
        self._outbox, self._identity = outbox, identity
        self._sent: dict[int, int] = {}
        self._done: dict[int, int] = {}
        self._cond = threading.Condition()

    def notify(self, transfer_id: int, index: int, slot: int, pieces: list[Piece]) -> None:
        with self._cond:
            self._sent[transfer_id] = max(self._sent.get(transfer_id, 0), index + 1)
        self._outbox.put(self._identity, encoder.encode(ChunkLanded(transfer_id, index, slot, pieces)))

    def on_done(self, transfer_id: int, index: int) -> None:
        """From the I/O thread; acks for unknown transfers or unsent chunks are dropped."""
        with self._cond:
            if index < self._sent.get(transfer_id, 0):
                self._done[transfer_id] = max(index, self._done.get(transfer_id, -1))
                self._cond.notify_all()

    def wait_done(self, transfer_id: int, index: int, timeout: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._done.get(transfer_id, -1) >= index, timeout=timeout):
                raise AckTimeout(f"transfer {transfer_id}: no ack for chunk {index} within {timeout} s")

    def end(self, transfer_id: int) -> None:
        with self._cond:
            self._sent.pop(transfer_id, None)
            self._done.pop(transfer_id, None)
