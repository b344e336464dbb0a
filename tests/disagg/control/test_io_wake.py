"""RouterIO and DealerIO wake(): another thread makes the loop's recv() return at once, so
what it queued beside the sockets (a vLLM step's loads in the connector's Handoff) is taken
now, not after the loop's poll timeout; a wake carries nothing and sends nothing."""

import threading
import time

import pytest
import zmq

from disagg.control.auth import AuthKey, Gate
from disagg.control.io import DealerIO, RouterIO
from disagg.control.messages import Heartbeat


@pytest.fixture
def gate():
    ctx = zmq.Context()
    g = Gate(ctx, AuthKey())
    yield g
    g.close()
    ctx.destroy(linger=0)


def _returns_soon_after_wake(io) -> float:
    """Seconds between a wake from another thread and the loop's recv(60 s) returning."""
    woke = []
    ready = threading.Event()

    def loop():
        ready.set()
        got = list(io.recv(60_000))
        woke.append((time.monotonic(), got))

    t = threading.Thread(target=loop)
    t.start()
    ready.wait(5)
    t0 = time.monotonic()
    io.wake()
    t.join(10)
    assert not t.is_alive(), "recv did not return within 10 s of wake()"
    assert woke[0][1] == []  # a wake is no message
    return woke[0][0] - t0


def test_a_wake_ends_a_routers_wait_at_once(gate):
    io = RouterIO(gate, "127.0.0.1")
    try:
        assert _returns_soon_after_wake(io) < 1.0
    finally:
        io.close()


def test_a_wake_ends_a_dealers_wait_at_once_and_its_sends_still_go(gate):
    router, dealer = RouterIO(gate, "127.0.0.1"), DealerIO(gate)
    try:
        assert _returns_soon_after_wake(dealer) < 1.0
        dealer.send(router.endpoint, Heartbeat(7), connect=True)
        dealer.wake()
        list(dealer.recv(0))
        deadline = time.monotonic() + 10
        got = []
        while not got and time.monotonic() < deadline:
            got = list(router.recv(100))
        assert [m for _, m in got] == [Heartbeat(7)]
    finally:
        dealer.close()
        router.close()
