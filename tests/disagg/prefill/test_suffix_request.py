"""prefix_len in decode's TransferRequest, through a real prefill server (real ZMQ, the memory
transport in this process): a decode that holds the prompt's first positions gets only the
rest, and a prefix_len it may not name is answered TransferDone(fail) with the reason before
anything is planned or moves. Decode here is a raw control socket with a receiver pool of
its own page size, so the test sees its bytes."""

import threading

import msgspec
import numpy as np
import pytest
import torch
import zmq

from disagg.control.messages import (
    PROTOCOL_VERSION,
    Decoder,
    LayoutInfo,
    RegisterDecode,
    Registered,
    ToDecode,
    TransferDone,
    TransferRequest,
    TransferStarted,
    encoder,
    indices_to_wire,
)
from disagg.engine.standin import StandInEngine
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.pool_settings import PoolSettings
from harness import memory
from kvpool import Component, HybridPool
from kvpool.geometry import item_bytes
from kvpool.positions import paged_components
from transfer.config import TransferConfig
from transfer.endpoint import PoolEndpoint

N, DECODE_PAGE = 100, 16


@pytest.fixture()
def prefill():
    memory.register()
    server = PrefillServer(
        PrefillConfig(
            pool=PoolSettings(preset="tiny-hybrid", max_tokens=2048, max_requests=4, device="cpu"),
            bootstrap_bind="tcp://127.0.0.1:*",
            transports=("memory",),
        )
    )
    yield server
    server.close()


@pytest.fixture()
def decode(prefill):
    """(control socket registered with prefill, its receiver) at page size 16 (prefill: 4)."""
    pool = HybridPool(
        PoolSettings(
            preset="tiny-hybrid", page_size=DECODE_PAGE, max_tokens=2048, max_requests=4, device="cpu"
        ).pool_config(swa_window_only=True)
    )
    receiver = PoolEndpoint(memory.MemoryTransport(), pool, TransferConfig())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(prefill.control_endpoint)
    own = prefill.layout
    layout = LayoutInfo(DECODE_PAGE, own.layout, receiver.buffers, own.model)
    assert isinstance(_ask(sock, RegisterDecode(PROTOCOL_VERSION, 1, layout, receiver.offers(), None)), Registered)
    yield sock, receiver
    sock.close()
    receiver.close()


def _ask(sock, msg, timeout_ms: int = 10_000):
    if msg is not None:
        sock.send(encoder.encode(msg))
    assert sock.poll(timeout_ms), "no answer"
    return Decoder(ToDecode, "test").decode(sock.recv())


def _prefix_bytes(pool: HybridPool, kv, prefix_len: int) -> list[bytes]:
    """The bytes of every paged component's pages holding positions [0, prefix_len)."""
    out = []
    for c in paged_components(pool):
        pages = kv.full_pages[: prefix_len // DECODE_PAGE]
        items = pool.swa_allocator.translate(pages) if c is Component.SWA else pages
        items = items[items != 0]
        for b in pool.pools[c].storage.buffers:
            out.append(b[torch.from_numpy(items.astype(np.int64))].numpy().tobytes())
    return out


def test_decode_holding_a_prefix_gets_only_the_rest(prefill, decode):
    sock, receiver = decode
    pool, model = receiver.pool, prefill.pool.config.model
    tokens = np.random.default_rng(1).integers(0, 50000, N)
    kv = pool.alloc_request(N, swa_window_only=True)
    for b in (b for p in pool.pools.values() for b in p.storage.buffers):
        b.random_(0, 256)  # decode's prefix: whatever it holds must stay
    before = _prefix_bytes(pool, kv, 80)
    sock.send(encoder.encode(TransferRequest(21, 1, N, indices_to_wire(pool.index_set(kv)), [], prefix_len=80)))
    out = {}
    worker = threading.Thread(target=lambda: out.update(prefill.prefill(21, tokens)))
    worker.start()
    answers = [_ask(sock, None), _ask(sock, None)]
    worker.join(30)
    assert isinstance(answers[0], TransferStarted)
    done = answers[1]
    assert isinstance(done, TransferDone) and done.ok, done
    paged = (N - 80) * sum(item_bytes(model, c, 1) for c in paged_components(pool) if c is not Component.SWA)
    swa = (N - 92) * item_bytes(model, Component.SWA, 1)  # the window (94..99) from prefill's page holding 94
    state = sum(item_bytes(model, c, 1) for c in pool.pools if c.per_request)
    assert done.report.nbytes == paged + swa + state == out["bytes"]
    assert _prefix_bytes(pool, kv, 80) == before, "decode's prefix was written"
    StandInEngine()._write_tokens(pool, kv, tokens, np.arange(80))  # the prefix as decode's cache holds it
    StandInEngine().verify(pool, kv, tokens, 21)


@pytest.mark.parametrize(
    "prefix_len,why",
    [(8, "not a multiple of the receiver's page size 16"), (-16, "negative"), (112, "beyond the prompt's 100 tokens")],
)
def test_a_prefix_len_decode_may_not_name_is_refused_and_nothing_moves(prefill, decode, prefix_len, why):
    sock, receiver = decode
    pool = receiver.pool
    kv = pool.alloc_request(N, swa_window_only=True)
    snapshot = [b.clone() for p in pool.pools.values() for b in p.storage.buffers]
    done = _ask(sock, TransferRequest(22, 1, N, indices_to_wire(pool.index_set(kv)), [], prefix_len=prefix_len))
    assert isinstance(done, TransferDone) and not done.ok and why in done.reason, done
    assert prefill.requests.get(22) is None  # no room was opened for it
    assert all(torch.equal(a, b) for a, b in zip(snapshot, (b for p in pool.pools.values() for b in p.storage.buffers)))


def test_the_wire_carries_prefix_len_and_defaults_it_to_zero():
    msg = TransferRequest(1, 2, 64, {}, [], prefix_len=48)
    assert Decoder(TransferRequest, "t").decode(encoder.encode(msg)).prefix_len == 48
    old = msgspec.msgpack.encode(
        {"type": "TransferRequest", "room": 1, "decode_epoch": 2, "num_tokens": 64, "indices": {}, "slots": []}
    )
    assert Decoder(TransferRequest, "t").decode(old).prefix_len == 0
    assert PROTOCOL_VERSION >= 5  # prefix_len arrived in 5
