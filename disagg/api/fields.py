"""Fields of a JSON request body: each helper returns the value or raises BadRequest (a 400
naming the field and what would be accepted)."""

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from disagg.errors import BadRequest


@dataclass(frozen=True)
class EventStream:
    """What a route returns to answer with server-sent events instead of one JSON body:
    `produce(send)` runs on the request's thread and calls send(event) per event. The status
    line goes out with the first event, so an error raised before it still gets its 4xx/5xx."""

    produce: Callable[[Callable[[dict], None]], None]


@dataclass(frozen=True)
class Reply:
    """What a route returns to answer with a status other than 200 and a JSON body (the
    router's failed /generate: a 5xx that still carries ok, reason, room and timings)."""

    status: int
    body: dict


Route = Callable[[dict], "dict | Reply | EventStream"]


def require(body: dict, key: str, kind: type):
    if key not in body:
        raise BadRequest(f"missing field {key!r}")
    value = body[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadRequest(f"field {key!r} must be {kind.__name__}")
    return value


def optional_int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequest(f"{key} must be an int in [{lo}, {hi}]")
    return value


STREAM_LAYERS = ("auto", "on", "off")  # layer-wise streaming of a request's KV (prefill)


def stream_layers(body: dict) -> str | None:
    """The optional `stream_layers` field: on, off or auto (None: the worker's --stream-layers)."""
    value = body.get("stream_layers")
    if value is not None and value not in STREAM_LAYERS:
        raise BadRequest(f"stream_layers must be one of {', '.join(STREAM_LAYERS)}")
    return value


def abort_route(abort: Callable[[int, str], dict]) -> Route:
    """POST /abort {room, reason?} for a worker."""
    return lambda body: abort(require_room(body), str(body.get("reason", "no reason given"))[:500])


def is_endpoint(value) -> bool:
    """Whether `value` is a ZMQ tcp://HOST:PORT endpoint."""
    if not isinstance(value, str) or not value.startswith("tcp://") or len(value) > 256:
        return False
    host, sep, port = value.removeprefix("tcp://").rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536 and not any(c.isspace() for c in value))


def named_endpoint(text: str) -> tuple[str, str]:
    """A flag value [NAME=]tcp://HOST:PORT -> (name, endpoint); no name: ("", endpoint)."""
    name, sep, endpoint = ("", "", text) if text.startswith("tcp://") else text.partition("=")
    if not is_endpoint(endpoint) or (sep and not name.replace("-", "").replace("_", "").isalnum()):
        raise argparse.ArgumentTypeError(f"{text!r}: want [NAME=]tcp://HOST:PORT (NAME: letters, digits, - or _)")
    return name, endpoint


def require_room(body: dict) -> int:
    room = require(body, "room", int)
    if not 0 <= room < 1 << 63:
        raise BadRequest("room must be in [0, 2^63)")
    return room


def require_tokens(body: dict, key: str = "token_ids", max_tokens: int = 1 << 20) -> np.ndarray:
    """A non-empty 1-D list of token ids in [0, 2^31) as an int64 array, or BadRequest."""
    value = require(body, key, list)
    if not 0 < len(value) <= max_tokens:
        raise BadRequest(f"{key} must hold 1 to {max_tokens} tokens")
    if not all(type(t) is int for t in value):
        raise BadRequest(f"{key} must be a list of ints")
    tokens = np.asarray(value, dtype=np.int64)
    if tokens.min() < 0 or tokens.max() >= 1 << 31:
        raise BadRequest(f"{key} must be in [0, 2^31)")
    return tokens
