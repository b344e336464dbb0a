import threading

import pytest

from disagg.engine.standin import StandInEngine


class StuckEngine(StandInEngine):
    """A prefill that blocks until released, so the request stays in flight."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def prefill(self, pool, req, token_ids, room, on_layer=None, *, cached=0):
        self.entered.set()
        self.release.wait(30)
        return super().prefill(pool, req, token_ids, room, on_layer, cached=cached)


@pytest.fixture(name="StuckEngine")
def stuck_engine_class():
    return StuckEngine
