"""Hop timestamps of a room's way through the connector's workers, for studying where a
small request's time goes (issue 34: decode's KV arrival). Off unless the environment sets
DISAGG_HOPS=1 when the module is imported; then each hop appends (time.perf_counter_ns(),
room, hop, the thread's name) to this process's list, and take() hands them over. perf_counter_ns is
CLOCK_MONOTONIC on Linux, one clock for every process of a host, so a producer's and a
consumer's marks line up. Nothing is logged: a recorder for a study, not a log.

    consumer  c.step -> c.taken -> c.asked -> (p.asked -> p.sending -> p.written -> p.told)
              -> c.done -> c.finished
"""

import os
import threading
import time

ENABLED = os.environ.get("DISAGG_HOPS") == "1"
_marks: list[tuple[int, int, str, str]] = []
_lock = threading.Lock()


def mark(room: int, hop: str) -> None:
    """This hop of `room`, now (a no-op unless enabled)."""
    if ENABLED:
        t = time.perf_counter_ns()
        with _lock:
            _marks.append((t, room, hop, threading.current_thread().name))


def take() -> list[tuple[int, int, str, str]]:
    """The marks since the last take, oldest first."""
    global _marks
    with _lock:
        out, _marks = _marks, []
    return out
