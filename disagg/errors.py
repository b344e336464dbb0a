"""The one exception tree, whole. The data path's branch lives in transfer/errors.py (transfer
must not import disagg); the control plane's branch lives here.

    DisaggError                              (transfer.errors)
     +-- TransferError                       moving bytes failed or would be unsafe
     |    +-- TransportError                 no common transport, a malformed offer, or settings
     |    |                                  a transport cannot start with
     |    +-- EngineError                    a transport call returned non-zero
     |    |    +-- EngineInitError, RegistrationError, WriteFailed, PeerUnreachable
     |    |                                          +-- WritesAbandoned (link closed mid-write)
     |    +-- PlanError                      refused before a single byte is written
     |    |    +-- OutOfBounds, IndexMismatch, LayoutIncompatible, BadPrefix
     |    +-- StagingError                   bad chunk notice, staging timeout or misuse
     |    |    +-- AckTimeout
     |    +-- InjectedFault                  a failure injected on purpose (transfer.faults)
     +-- Cancelled                           the request was aborted (client, router or peer)
     +-- ProtocolError                       a control-plane message refused, or a peer silent
     |    +-- Unanswered                     a registration got no answer in time: look up again
     +-- Overloaded                          admission refused: queue or pool full (HTTP 503)
     +-- Unavailable                         no pair can serve: each is down, with why (HTTP 503)
     +-- BadRequest                          invalid API input (HTTP 400)
     +-- RequestFailed                       a worker failed the request (HTTP 5xx, OpenAI API)
     +-- TooLarge (also ValueError)          a request that never fits the pool (HTTP 400)
     +-- VerifyError                         decode found bytes that are not the prompt's KV
     +-- ConfigError                         a flag or file the process cannot start with
"""

from transfer.errors import Cancelled, DisaggError, TransferError

__all__ = [
    "BadRequest",
    "Cancelled",
    "ConfigError",
    "DisaggError",
    "Overloaded",
    "ProtocolError",
    "RequestFailed",
    "TooLarge",
    "TransferError",
    "Unanswered",
    "Unavailable",
    "VerifyError",
]


class ProtocolError(DisaggError):
    pass


class Unanswered(ProtocolError):
    """A prefill did not answer our registration in time: it may have died, and the bootstrap
    may name its successor by now (decode looks the rank up again while its deadline lasts)."""


class Overloaded(DisaggError):
    pass


class Unavailable(DisaggError):
    """Nothing that could serve the request is up now (the router's pairs): try again later."""


class BadRequest(DisaggError):
    """`param`: the request field at fault, where one is (OpenAI's error object names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestFailed(DisaggError):
    """The router's pair failed a request the caller could not have fixed (prefill, transfer
    or decode), where the answer has no room for an `ok: false`: HTTP `status` (502 unless
    the router said 503 unreachable, 504 deadline, 500 verification, 409 aborted)."""

    def __init__(self, reason: str, status: int = 502):
        super().__init__(reason)
        self.status = status


class TooLarge(DisaggError, ValueError):
    """The request needs more than the whole pool holds."""


class VerifyError(DisaggError):
    pass


class ConfigError(DisaggError):
    """Raised before anything starts; the CLI prints it as one line."""
