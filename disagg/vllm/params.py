"""The kv_transfer_params a request carries through vLLM between prefill, proxy and decode.

vLLM's P/D proxies (its toy proxy, ours) speak NIXL's two flags: the proxy sends the prompt to
the producer with `do_remote_decode: true`; the producer's answer carries the params the proxy
hands to the consumer, `do_remote_prefill: true` plus the connector's own fields. Ours sit
under one key, "disagg", so no other connector's keys are read or clobbered:

    {"do_remote_prefill": true, "do_remote_decode": false,
     "disagg": {"room": 123, "bootstrap": "tcp://10.0.0.1:8998", "num_tokens": 301}}

These params come from a client through the proxy: untrusted. A malformed "disagg" block is
refused with one line (ParamsError) and nothing is recorded.
"""

import re
import secrets
from typing import Any

import msgspec

ROOM_BITS = 62
_ENDPOINT = re.compile(r"^tcp://[A-Za-z0-9.\-\[\]:]{1,253}:[0-9]{1,5}$")


class ParamsError(ValueError):
    """kv_transfer_params that cannot be what a DisaggConnector producer wrote."""


class RemotePrefill(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where a consumer finds a prompt's KV: the producer holds it under `room` until the
    consumer asks (or its hold deadline passes); `bootstrap` names the producer instance."""

    room: int
    bootstrap: str
    num_tokens: int

    def __post_init__(self) -> None:
        if not 0 < self.room < 1 << ROOM_BITS:
            raise ParamsError(f"disagg.room {self.room} outside (0, 2**{ROOM_BITS})")
        if not _ENDPOINT.match(self.bootstrap):
            raise ParamsError(f"disagg.bootstrap {self.bootstrap[:80]!r} is not tcp://host:port")
        if self.num_tokens < 1:
            raise ParamsError(f"disagg.num_tokens {self.num_tokens} must be positive")

    def to_params(self) -> dict[str, Any]:
        """The params a producer returns (what the proxy hands the consumer)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "disagg": {"room": self.room, "bootstrap": self.bootstrap, "num_tokens": self.num_tokens},
        }


def new_room() -> int:
    """A random room number (the request's name on both sides, as the router draws them)."""
    return secrets.randbits(ROOM_BITS) or 1


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """A producer's request whose KV a consumer will take (the proxy's `do_remote_decode`)."""
    return bool(params) and params.get("do_remote_decode") is True


def remote_prefill(params: dict[str, Any] | None) -> RemotePrefill | None:
    """The consumer's side: where its prompt's KV waits, or None for a request without any
    (a plain request, or another connector's params). Raises ParamsError for a malformed one."""
    if not params or params.get("do_remote_prefill") is not True or "disagg" not in params:
        return None
    try:
        return msgspec.convert(params["disagg"], RemotePrefill)
    except msgspec.ValidationError as exc:
        raise ParamsError(f"kv_transfer_params.disagg: {exc}") from None
