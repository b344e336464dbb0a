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


MARK = "deadline of"  # in every timeout's reason, never in another's


def passed(side: str, phase: str, limit_s: float, missing: str) -> str:
    """The failure reason of a request whose phase outlived its deadline (both roles say it
    this way, so the router can tell a timeout from other failures: `is_timeout`)."""
    return f"{side}: {phase} {MARK} {limit_s:g} s passed ({missing})"


def is_timeout(reason: str) -> bool:
    return MARK in reason
