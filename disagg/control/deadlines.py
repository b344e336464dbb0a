"""Deadlines: how long each phase of a request may last, counted from entering it. Each
role's request table (prefill/requests.py, decode/requests.py) says which of its phases
count against which deadline:

    deadline     prefill waits for                       decode waits for
    bootstrap    decode's TransferRequest                lookup, registration, pool space
    waiting      its own KV (or the prompt, orphaned)    prefill's TransferStarted
    transfer     the send                                prefill's TransferDone
"""

from dataclasses import dataclass


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
