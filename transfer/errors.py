"""The data path's exceptions and the root of the one exception tree (drawn whole in
disagg/errors.py, which adds the control plane's branch).

    DisaggError
     +-- TransferError                  moving bytes failed or would be unsafe
     |    +-- TransportError            no common transport, a malformed offer, or settings
     |    |                             a transport cannot start with
     |    +-- EngineError               a transport call returned non-zero (code, peer, nbytes)
     |    |    +-- EngineInitError      initialize() failed
     |    |    +-- RegistrationError    (un)registering memory failed
     |    |    +-- WriteFailed          a batched write failed (peer died, queue full, bad dst)
     |    |    +-- PeerUnreachable      the session health probe failed, or the link was closed
     |    |         +-- WritesAbandoned  the link closed with writes in flight (the peer was
     |    |                              lost): they may still land until the transport ends them
     |    +-- PlanError                 refused before a single byte is written
     |    |    +-- OutOfBounds          a range or index outside what the peer registered
     |    |    +-- IndexMismatch        per-request components of different lengths
     |    |    +-- LayoutIncompatible   the two sides' buffers do not pair up
     |    |    +-- BadPrefix            a prefix_len not page-aligned on the receiver, negative,
     |    |                             or beyond the prompt (transfer.suffix)
     |    +-- StagingError              bad chunk notice, staging timeout or misuse
     |    |    +-- AckTimeout           no ChunkDone for a staged chunk in time
     |    +-- InjectedFault             a failure injected on purpose (transfer.faults)
     +-- Cancelled                      the request was aborted (client, router or peer): a
                                        send stops before its next write

Transport return codes become typed exceptions inside the transport (transfer.transports);
nothing above it sees a bare integer code.
"""


class DisaggError(Exception):
    """Root of every error disagg raises on purpose."""


class TransferError(DisaggError):
    pass


class TransportError(TransferError):
    pass


class EngineError(TransferError):
    def __init__(self, op: str, code: int, peer: str | None = None, nbytes: int = 0, detail: str = ""):
        where = f" to {peer}" if peer else ""
        size = f" ({nbytes} bytes)" if nbytes else ""
        super().__init__(f"{op}{where}{size} failed with code {code}{': ' + detail if detail else ''}")
        self.op = op
        self.code = code
        self.peer = peer
        self.nbytes = nbytes


class EngineInitError(EngineError):
    pass


class RegistrationError(EngineError):
    pass


class WriteFailed(EngineError):
    pass


class PeerUnreachable(EngineError):
    pass


class WritesAbandoned(PeerUnreachable):
    pass


class PlanError(TransferError):
    pass


class OutOfBounds(PlanError):
    pass


class IndexMismatch(PlanError):
    pass


class LayoutIncompatible(PlanError):
    pass


class BadPrefix(PlanError):
    pass


class StagingError(TransferError):
    pass


class AckTimeout(StagingError):
    pass


class InjectedFault(TransferError):
    pass


class Cancelled(DisaggError):
    pass
