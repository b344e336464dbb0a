"""What a DisaggWorker's transfers did since vLLM last asked: the plain data vLLM's KV connector
stats carry from each worker to the server's logger and /metrics (disagg.vllm.metrics wraps
it in vLLM's classes; this module does not import vLLM).

    per transfer that moved (lists)      load_seconds, load_bytes   consumer: asked -> landed
                                         send_seconds, send_bytes   producer: the send call
    counts                               load_failures              a load that ended failed
                                                                    (not one vLLM aborted)
                                         send_failures              a send that did not land
                                         holds_expired              a held room no consumer
                                                                    asked for within hold_s

Bytes are what the producer's send wrote (its TransferReport; on the consumer, the report that
came in its TransferDone, checked there as untrusted: never negative). The data is a dict of
lists and ints only: vLLM sends it from its workers to its engine core and on to the server
process, and adds up several workers' (TP ranks) and several steps' by `merge`.
"""

import enum
from dataclasses import dataclass
from typing import Any

LISTS = ("load_seconds", "load_bytes", "send_seconds", "send_bytes")
COUNTS = ("load_failures", "send_failures", "holds_expired")


class End(enum.Enum):
    MOVED = "moved"
    FAILED = "failed"
    EXPIRED = "expired"  # producer: no consumer asked within hold_s


@dataclass(frozen=True)
class Ended:
    """How one load or send ended; `seconds` and `nbytes` for one that moved."""

    how: End
    seconds: float = 0.0
    nbytes: int = 0


def empty() -> dict[str, Any]:
    return {**{k: [] for k in LISTS}, **{k: 0 for k in COUNTS}}


def record(data: dict[str, Any], side: str, ended: Ended) -> None:
    """Count one load (side "load") or send ("send") into `data`."""
    if ended.how is End.MOVED:
        data[f"{side}_seconds"].append(ended.seconds)
        data[f"{side}_bytes"].append(ended.nbytes)
    elif ended.how is End.FAILED:
        data[f"{side}_failures"] += 1
    else:
        data["holds_expired"] += 1


def merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """`into` with `other`'s figures added (another worker's, or a later step's)."""
    for k in LISTS:
        into[k].extend(other.get(k, ()))
    for k in COUNTS:
        into[k] += other.get(k, 0)
    return into


def is_empty(data: dict[str, Any]) -> bool:
    return not any(data[k] for k in LISTS + COUNTS)


def summary(data: dict[str, Any]) -> dict[str, int | float]:
    """The figures of an interval as vLLM's log line shows them ("KV Transfer metrics: ..."):
    a side only where it did something."""
    out: dict[str, int | float] = {}
    for side, failures in (("load", "load_failures"), ("send", "send_failures")):
        seconds, nbytes = data[f"{side}_seconds"], data[f"{side}_bytes"]
        if not (seconds or data[failures]):
            continue
        out[f"{side}s"] = len(seconds)
        if seconds:
            out[f"{side} ms avg"] = round(1e3 * sum(seconds) / len(seconds), 3)
            out[f"{side} ms max"] = round(1e3 * max(seconds), 3)
            out[f"{side} MB"] = round(sum(nbytes) / 2**20, 3)
        out[f"{side} failures"] = data[failures]
    if data["holds_expired"]:
        out["holds expired"] = data["holds_expired"]
    return out
