"""LoadMeter: the requests a worker rank holds now, queued then running, with their prompt
tokens: what its /health's `load` says (disagg/control/load.py) so that every router in front
of it, not only the one that sent a request, sees what it is busy with.

    with meter.held(r, len(tokens)):     arrived: queued
        ... admission ...
        meter.admitted(r)                 its pages are allocated: running
        ...                               until it is answered (the block ends)

A request is keyed by its record (the role's PrefillRequest or DecodeRequest: one per request,
compared by identity), so the admission step finds it without a handle passed down.
"""

import threading
from contextlib import contextmanager
from enum import Enum
from typing import Iterator

from disagg.control.load import WorkerLoad


class Stage(Enum):
    QUEUED = "arrived, not admitted"
    RUNNING = "admitted, not answered"


class LoadMeter:
    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[object, tuple[Stage, int]] = {}  # request record -> its stage, prompt tokens

    @contextmanager
    def held(self, request: object, tokens: int) -> Iterator[None]:
        """`request` (its record) counts, queued, until the block ends."""
        with self._lock:
            self._held[request] = (Stage.QUEUED, tokens)
        try:
            yield
        finally:
            with self._lock:
                self._held.pop(request, None)

    def admitted(self, request: object) -> None:
        """`request` got its pages: running from now on (nothing if it is not held)."""
        with self._lock:
            if request in self._held:
                self._held[request] = (Stage.RUNNING, self._held[request][1])

    def now(self) -> WorkerLoad:
        with self._lock:
            held = list(self._held.values())
        count = {stage: [t for s, t in held if s is stage] for stage in Stage}
        return WorkerLoad(
            queued_requests=len(count[Stage.QUEUED]),
            queued_tokens=sum(count[Stage.QUEUED]),
            running_requests=len(count[Stage.RUNNING]),
            running_tokens=sum(count[Stage.RUNNING]),
        )
