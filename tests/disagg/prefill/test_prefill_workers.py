"""A prefill server's transfer workers (one shard per decode peer) with an engine that runs
one forward pass at a time, as a real model engine does: a streamed request takes a worker
only once the engine runs it, so a request that already computed is never stuck behind one
still waiting for the engine. Real servers in process, real ZMQ, the memory transport."""

import threading

import numpy as np
import pytest

from disagg.errors import DisaggError
from disagg.decode.server import DecodeConfig, DecodeServer
from disagg.engine.standin import StandInEngine
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.pool_settings import PoolSettings
from harness import memory
from kvpool import HybridPool


class OneAtATime(StandInEngine):
    """The stand-in behind one lock (one forward pass at a time); a room's prefill waits at
    its gate (opened by the test) before it queues for the lock."""

    def __init__(self, rooms):
        super().__init__(layer_ms=1.0)
        self.lock = threading.Lock()
        self.gates = {room: threading.Event() for room in rooms}
        self.arrived = {room: threading.Event() for room in rooms}
        self.fails: dict[int, Exception] = {}  # room -> raised before its first layer

    def prefill(self, pool, req, token_ids, room, on_layer=None, *, cached=0):
        self.arrived[room].set()
        assert self.gates[room].wait(60), f"room {room}: gate never opened"
        with self.lock:
            if room in self.fails:
                raise self.fails[room]
            return super().prefill(pool, req, token_ids, room, on_layer, cached=cached)


def _pool() -> PoolSettings:
    return PoolSettings(preset="tiny-swa", max_tokens=2048, max_requests=4, device="cpu")


@pytest.fixture()
def pair():
    memory.register()
    engine = OneAtATime([1, 2])
    prefill = PrefillServer(
        PrefillConfig(
            pool=_pool(),
            bootstrap_bind="tcp://127.0.0.1:*",
            transports=("memory",),
            transfer_workers=1,
            stream_layers="on",
        ),
        model=engine,
    )
    decode = DecodeServer(DecodeConfig(pool=_pool(), bootstrap_addr=prefill.bootstrap_endpoint, transports=("memory",)))
    yield prefill, decode, engine
    for gate in engine.gates.values():
        gate.set()
    decode.close()
    prefill.close()


def test_a_streamed_request_waiting_for_the_engine_holds_no_transfer_worker(pair, eventually):
    """Room 1 is admitted and streams, but the engine has not started it; room 2 computes
    and must be sent by the one transfer worker meanwhile. Then room 1 runs and is sent too."""
    prefill, decode, engine = pair
    tokens, out = {1: np.arange(40) % 97, 2: np.arange(50) % 89}, {}
    run = {
        room: [
            threading.Thread(
                target=lambda room=room: out.__setitem__(("decode", room), decode.decode(room, tokens[room]))
            ),
            threading.Thread(
                target=lambda room=room: out.__setitem__(("prefill", room), prefill.prefill(room, tokens[room]))
            ),
        ]
        for room in (1, 2)
    }
    for t in run[1]:
        t.start()
    assert engine.arrived[1].wait(10)  # room 1's pages are allocated, its engine call waits at the gate
    eventually(lambda: len(prefill.requests.get(1).dests) == 1, 10, "decode's TransferRequest for room 1")
    engine.gates[2].set()
    run[2][0].start()  # decode asks first, so room 2 streams too
    eventually(lambda: (r := prefill.requests.get(2)) is not None and len(r.dests) == 1, 10, "room 2's request")
    run[2][1].start()
    for t in run[2]:
        t.join(30)
    assert out[("prefill", 2)]["state"] == "SUCCESS" and out[("decode", 2)]["verified"], out
    assert out[("prefill", 2)]["streamed"]
    assert not engine.gates[1].is_set() and ("prefill", 1) not in out  # room 1 still waits for the engine
    engine.gates[1].set()
    for t in run[1]:
        t.join(30)
    assert out[("prefill", 1)]["state"] == "SUCCESS" and out[("decode", 1)]["verified"], out
    assert out[("prefill", 1)]["streamed"]
    for server in (prefill, decode):
        assert server.available() == HybridPool(server.pool.config).available()


def test_a_streamed_request_that_fails_before_its_first_layer_frees_its_pages(pair, eventually):
    """Room 1 is aborted while it waits for the engine (nothing handed to the table yet): it
    fails on both sides, and its pages are free once the engine returns."""
    prefill, decode, engine = pair
    tokens, out = np.arange(40) % 97, {}
    threads = [
        threading.Thread(target=lambda: out.__setitem__("decode", decode.decode(1, tokens))),
        threading.Thread(target=lambda: out.__setitem__("prefill", prefill.prefill(1, tokens))),
    ]
    for t in threads:
        t.start()
    assert engine.arrived[1].wait(10)
    eventually(lambda: len(prefill.requests.get(1).dests) == 1, 10, "decode's TransferRequest")
    assert prefill.requests.fail(prefill.requests.get(1), "aborted before the engine ran it")
    engine.gates[1].set()
    for t in threads:
        t.join(30)
    assert out["prefill"]["state"] == "FAILED" and out["prefill"]["reason"] == "aborted before the engine ran it", out
    assert out["decode"]["state"] != "SUCCESS", out
    for server in (prefill, decode):
        assert server.available() == HybridPool(server.pool.config).available()


@pytest.mark.parametrize("stream", ["on", "off"])
@pytest.mark.parametrize(
    "error",
    [DisaggError("the engine is out of memory"), RuntimeError("CUDA error")],
    ids=["DisaggError", "RuntimeError"],
)
def test_an_engine_that_raises_before_its_first_layer_fails_the_request_on_both_sides(pair, eventually, stream, error):
    """Whatever the engine raises before its first layer (nothing handed to the table yet):
    the request fails at once on both sides (decode is told, not left to its deadline), its
    pages are freed once, and the server serves the next request."""
    prefill, decode, engine = pair
    tokens, out = np.arange(40) % 97, {}

    def prefill_call():
        try:
            out["prefill"] = prefill.prefill(1, tokens, stream=stream)
        except RuntimeError as exc:  # not ours to turn into an answer: the HTTP layer's 500
            out["prefill"] = exc

    threads = [
        threading.Thread(target=lambda: out.__setitem__("decode", decode.decode(1, tokens))),
        threading.Thread(target=prefill_call),
    ]
    for t in threads:
        t.start()
    eventually(lambda: (r := prefill.requests.get(1)) is not None and len(r.dests) == 1, 10, "decode's request")
    engine.fails[1] = error
    engine.gates[1].set()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), out  # decode heard the failure, not its deadline
    assert out["decode"]["state"] != "SUCCESS", out
    if isinstance(error, RuntimeError):
        assert out["prefill"] is error
    else:
        assert out["prefill"]["state"] == "FAILED" and "out of memory" in out["prefill"]["reason"], out
    assert prefill.requests.get(1) is None
    for server in (prefill, decode):
        assert server.available() == HybridPool(server.pool.config).available()
    engine.gates[2].set()  # the next request is served
    threads = [
        threading.Thread(target=lambda: out.__setitem__("decode2", decode.decode(2, tokens))),
        threading.Thread(target=lambda: out.__setitem__("prefill2", prefill.prefill(2, tokens, stream=stream))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out["prefill2"]["state"] == "SUCCESS" and out["decode2"]["verified"], out
