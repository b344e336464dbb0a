"""A ChunkChannel over one ZMQ PAIR socket between a sender and a receiver process, for
point-to-point use (benchmarks, tests); the control plane carries the same messages itself."""

import msgspec
import zmq

from transfer.errors import AckTimeout, StagingError
from transfer.staging import ChunkDone, ChunkLanded

_decoder = msgspec.msgpack.Decoder(ChunkLanded | ChunkDone)
_encoder = msgspec.msgpack.Encoder()


class PairChannel:
    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self._sent: dict[int, int] = {}  # transfer id -> chunks notified
        self._done: dict[int, int] = {}  # transfer id -> highest chunk reported done

    # sender side
    def notify(self, notice: ChunkLanded) -> None:
        self._sent[notice.transfer_id] = max(self._sent.get(notice.transfer_id, 0), notice.index + 1)
        self.socket.send(_encoder.encode(notice))

    def wait_done(self, transfer_id: int, index: int, timeout: float) -> None:
        while self._done.get(transfer_id, -1) < index:
            if not self.socket.poll(int(timeout * 1000)):
                raise AckTimeout(f"transfer {transfer_id}: no ack for chunk {index} within {timeout} s")
            match _decoder.decode(self.socket.recv()):
                case ChunkDone(transfer_id=t) if t not in self._sent:
                    continue  # a late ack of a transfer that already ended (failed or aborted)
                case ChunkDone(transfer_id=t, index=i) if i < self._sent.get(t, 0):
                    self._done[t] = max(i, self._done.get(t, -1))
                case ChunkDone(transfer_id=t, index=i):
                    raise StagingError(f"ack for chunk {i} of transfer {t}, which was never sent")
                case other:
                    raise StagingError(f"unexpected message on the chunk channel: {type(other).__name__}")

    def end(self, transfer_id: int) -> None:
        """Forget a finished (or failed) transfer's chunk state."""
        self._sent.pop(transfer_id, None)
        self._done.pop(transfer_id, None)

    # receiver side
    def recv_notice(self, timeout: float) -> ChunkLanded:
        if not self.socket.poll(int(timeout * 1000)):
            raise StagingError(f"no chunk notice within {timeout} s")
        raw = self.socket.recv()
        try:
            message = _decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise StagingError(f"undecodable chunk notice: {exc}") from None
        match message:
            case ChunkLanded() as notice:
                return notice
            case other:
                raise StagingError(f"unexpected message on the chunk channel: {type(other).__name__}")

    def send_done(self, done: ChunkDone) -> None:
        self.socket.send(_encoder.encode(done))
