"""ChunkRelay: the staged-transfer ChunkChannel carried over the control plane.

The prefill side sends ChunkLanded through its control socket and waits here for the
ChunkDone acks that its loop delivers with on_done()."""

from disagg.control.io import RouterIO
from disagg.control.messages import ChunkLanded
from transfer.leases import AckLedger
from transfer.staging import Piece


class ChunkRelay:
    def __init__(self, io: RouterIO, identity: bytes):
        self._io, self._identity = io, identity
        self._ledger = AckLedger()

    def notify(self, transfer_id: int, index: int, slot: int, pieces: list[Piece]) -> None:
        self._ledger.sent(transfer_id, index)
        self._io.send(self._identity, ChunkLanded(transfer_id, index, slot, pieces))

    def on_done(self, transfer_id: int, index: int) -> None:
        """From the loop thread; acks for unknown transfers or unsent chunks are dropped."""
        self._ledger.acked(transfer_id, index)

    def wait_done(self, transfer_id: int, index: int, timeout: float) -> None:
        self._ledger.wait(transfer_id, index, timeout)

    def end(self, transfer_id: int) -> None:
        self._ledger.end(transfer_id)
