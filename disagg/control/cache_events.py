"""CacheEvents: a worker's answer to POST /cache/events, what its prefix cache holds by chained
page key (kvpool.cache.blocks.chain_keys), for the router's index (disagg/router/cache_index.py).

    {"type": "CacheEvents", "epoch": E, "seq": S, "page_size": P, "align": A, "reset": false,
     "added": [k, ...], "evicted": [k, ...]}        what changed after the caller's `since`
                                                    (asked with {"since": S, "epoch": E})
                                                    (k: a uint64 key's bits read as int64)
    ... "reset": true, "added": [every key held]     the whole contents (new caller, another
                                                    epoch, or behind)

`align` (optional; the page when absent): a hit's length is a multiple of it, in tokens (a
prefill of the model engine resumes only where a pass of its chunk starts), so the router
predicts what the worker will take, not only what it holds.

It comes over plain HTTP from a process the router does not authenticate (worker HTTP is
guarded by the network only, docs/security.md), so it is decoded into a bounded, typed
struct and checked before anything reads it: a malformed or oversized answer is refused
whole with the reason (CacheEventsError), never half applied. The worst a lying worker can
do with a well-formed one is draw requests to itself or away from itself, which it can also
do by answering slowly; it cannot change what any request computes.
"""

from typing import Annotated

import msgspec

MAX_KEYS = 1 << 20  # keys in one answer (16M cached tokens at page size 16)
MAX_BYTES = 24 << 20  # an answer's JSON (a key is at most 20 digits and a comma)
Key = Annotated[int, msgspec.Meta(ge=-(1 << 63), le=(1 << 63) - 1)]  # a uint64 key read as int64
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_KEYS)]


class CacheEventsError(ValueError):
    """A worker's cache answer the router cannot take: why, in one line."""


class CacheEvents(msgspec.Struct, tag=True, frozen=True):
    epoch: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # the worker process's (new on a restart)
    seq: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]  # its journal's number after these changes
    page_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]
    reset: bool  # added is everything it holds
    added: Keys = []
    evicted: Keys = []
    align: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] | None = (
        None  # tokens a hit is a multiple of (None: the page)
    )

    def __post_init__(self) -> None:
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size {self.page_size} is not a power of two")
        if self.align is not None and self.align % self.page_size:
            raise ValueError(f"align {self.align} is not a multiple of the page size {self.page_size}")
        if self.reset and self.evicted:
            raise ValueError("a reset names what is held, so it evicts nothing")


def decode_events(raw: bytes) -> CacheEvents:
    """The answer's body -> CacheEvents, or CacheEventsError naming what is wrong."""
    if len(raw) > MAX_BYTES:
        raise CacheEventsError(f"answer of {len(raw)} bytes, more than {MAX_BYTES}")
    try:
        return msgspec.json.decode(raw, type=CacheEvents)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise CacheEventsError(f"malformed: {str(exc)[:200]}") from None


def encode_events(events: CacheEvents) -> dict:
    """As the route answers it (a JSON object)."""
    return msgspec.to_builtins(events)
