"""WorkerLoad: how many requests a worker rank holds and how many prompt tokens they carry, as
its /health says it (`"load"`) for the routers in front of it (disagg/router/load.py).

    "load": {"type": "WorkerLoad", "queued_requests": 1, "queued_tokens": 300,
             "running_requests": 2, "running_tokens": 900}

    queued    arrived, not admitted yet (waiting for pool space; decode: also looking its
              prefill up)
    running   admitted until answered (prefill: computing, waiting for decode, sending;
              decode: receiving, verifying, generating)

Why the worker says it: a router counts only the requests it sent itself, and a deployment
runs several routers in front of the same workers; each would pile onto the pair the others
keep busy. Every router polls /health each round already, so the figure rides that answer.

It comes over plain HTTP from a process the router does not authenticate, so the router
decodes it into this typed struct before reading it (`read_load`): a value that is not one
(missing, not an object, a field missing or not a non-negative int, tokens without a request)
is refused whole with the reason (LoadError), and a number beyond its cap is read as the cap.
A lying worker can only draw requests to itself (too low: the router still counts its own
requests there, disagg/router/load.py) or push them away (too high), which it can do by
answering slowly anyway; it cannot change what a request computes.
"""

from typing import Annotated

import msgspec

MAX_REQUESTS = 1 << 20  # a worker's report is read as at most this many requests...
MAX_TOKENS = 1 << 40  # ... and this many prompt tokens, in each of queued and running
Count = Annotated[int, msgspec.Meta(ge=0)]


class LoadError(ValueError):
    """A worker's load the router cannot take: why, in one line."""


class WorkerLoad(msgspec.Struct, tag=True, frozen=True):
    queued_requests: Count
    queued_tokens: Count
    running_requests: Count
    running_tokens: Count

    def __post_init__(self) -> None:
        for stage in ("queued", "running"):
            if getattr(self, f"{stage}_tokens") and not getattr(self, f"{stage}_requests"):
                raise ValueError(f"{stage} tokens without a {stage} request")

    @property
    def tokens(self) -> int:
        """The prompt tokens it holds, queued or running: what the router weighs."""
        return self.queued_tokens + self.running_tokens


IDLE = WorkerLoad(0, 0, 0, 0)


def read_load(value: object) -> WorkerLoad:
    """A /health's `load` (its JSON, parsed) -> WorkerLoad with every number capped, or
    LoadError naming what is wrong."""
    try:
        load = msgspec.convert(value, WorkerLoad)
    except msgspec.ValidationError as exc:
        raise LoadError(f"malformed load: {str(exc)[:200]}") from None
    return WorkerLoad(
        queued_requests=min(load.queued_requests, MAX_REQUESTS),
        queued_tokens=min(load.queued_tokens, MAX_TOKENS),
        running_requests=min(load.running_requests, MAX_REQUESTS),
        running_tokens=min(load.running_tokens, MAX_TOKENS),
    )


def encode_load(load: WorkerLoad) -> dict:
    """As /health carries it (a JSON object)."""
    return msgspec.to_builtins(load)
