"""A ChunkChannel over one ZMQ PAIR socket between a sender and a receiver process, for
point-to-point use (benchmarks, tests); the control plane carries the same notices itself."""

import threading
import time

import msgspec
import zmq

from harness.wire import ChunkDone, ChunkLanded, Chunks
from transfer.errors import AckTimeout, StagingError
from transfer.leases import AckLedger
from transfer.staging import Piece

_decoder = msgspec.msgpack.Decoder(Chunks)
_encoder = msgspec.msgpack.Encoder()


class PairChannel:
    """Thread-safe on the sender side: several senders (one per prefill rank of a TP instance)
    share one peer's socket; the socket is used under a lock, and a sender waiting for an ack
    pumps it in short turns, so an ack another sender reads is counted for the one it is for."""

    TURN_S = 0.002  # longest hold of the socket by one waiting sender

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self._ledger = AckLedger()
        self._lock = threading.Lock()

    # sender side
    def notify(self, transfer_id: int, index: int, slot: int, pieces: list[Piece]) -> None:
        self._ledger.sent(transfer_id, index)
        with self._lock:
            self.socket.send(_encoder.encode(ChunkLanded(transfer_id, index, slot, pieces)))

    def wait_done(self, transfer_id: int, index: int, timeout: float) -> None:
        give_up = time.monotonic() + timeout
        while not self._ledger.done(transfer_id, index):
            left = give_up - time.monotonic()
            if left <= 0:
                raise AckTimeout(f"transfer {transfer_id}: no ack for chunk {index} within {timeout} s")
            with self._lock:
                if self.socket.poll(max(1, int(min(left, self.TURN_S) * 1000))):
                    self._take(_decoder.decode(self.socket.recv()))

    def _take(self, message) -> None:
        match message:
            case ChunkDone(transfer_id=t) if not self._ledger.knows(t):
                pass  # a late ack of a transfer that already ended (failed or aborted)
            case ChunkDone(transfer_id=t, index=i):
                if not self._ledger.acked(t, i):
                    raise StagingError(f"ack for chunk {i} of transfer {t}, which was never sent")
            case other:
                raise StagingError(f"unexpected message on the chunk channel: {type(other).__name__}")

    def end(self, transfer_id: int) -> None:
        """Forget a finished (or failed) transfer's chunk state."""
        self._ledger.end(transfer_id)

    # receiver side
    def recv_notice(self, timeout: float) -> ChunkLanded:
        if not self.socket.poll(int(timeout * 1000)):
            raise StagingError(f"no chunk notice within {timeout} s")
        try:
            message = _decoder.decode(self.socket.recv())
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise StagingError(f"undecodable chunk notice: {exc}") from None
        if not isinstance(message, ChunkLanded):
            raise StagingError(f"unexpected message on the chunk channel: {type(message).__name__}")
        return message

    def send_done(self, done: ChunkDone) -> None:
        self.socket.send(_encoder.encode(done))
