"""Per-peer transport choice through the real control plane (servers in this process, real
ZMQ; Mooncake on loopback and the fake memory transport, which only works in one process):
decode offers its transports in order of preference, prefill takes the first it has."""

import numpy as np
import pytest

from disagg.decode.server import DecodeConfig, DecodeServer
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.pool_settings import PoolSettings
from harness import memory

pytestmark = pytest.mark.slow
POOL = PoolSettings(preset="tiny-hybrid", max_tokens=2048, max_requests=4, device="cpu")


@pytest.fixture
def pair(request):
    memory.register()
    prefill_kinds, decode_kinds = request.param
    prefill = PrefillServer(PrefillConfig(pool=POOL, bootstrap_bind="tcp://127.0.0.1:*", transports=prefill_kinds))
    decode = DecodeServer(DecodeConfig(pool=POOL, bootstrap_addr=prefill.bootstrap_endpoint, transports=decode_kinds))
    yield prefill, decode
    decode.close()
    prefill.close()


def _run(prefill, decode, room: int) -> tuple[dict, dict]:
    import threading

    tokens = np.arange(700)
    pre: dict = {}
    t = threading.Thread(target=lambda: pre.update(prefill.prefill(room, tokens)))
    t.start()
    dec = decode.decode(room, tokens, 2)
    t.join(30)
    return pre, dec


@pytest.mark.parametrize(
    "pair,picked",
    [
        ((("mooncake",), ("memory", "mooncake")), "mooncake"),  # decode prefers memory; prefill lacks it
        ((("mooncake", "memory"), ("memory", "mooncake")), "memory"),  # decode's preference wins
        ((("memory", "mooncake"), ("mooncake", "memory")), "mooncake"),
    ],
    indirect=["pair"],
)
def test_prefill_takes_decodes_first_choice_it_can_reach(pair, picked):
    prefill, decode = pair
    pre, dec = _run(prefill, decode, 1)
    assert dec["state"] == "SUCCESS" and dec["verified"] and dec["transport"] == picked, dec
    assert pre["state"] == "SUCCESS" and pre["transport"] == picked


@pytest.mark.parametrize("pair", [(("mooncake",), ("memory",))], indirect=True)
def test_no_common_transport_is_refused_with_both_lists(pair):
    prefill, decode = pair
    before = prefill.available(), decode.pool.available()
    dec = decode.decode(2, np.arange(50), 1)
    assert dec["state"] == "FAILED"
    assert "no common transport: peer offers ['memory'], we have ['mooncake']" in dec["reason"]
    assert (prefill.available(), decode.pool.available()) == before


def test_a_link_is_closed_when_its_peer_registers_again_or_goes_silent(eventually):
    """What a mapping transport must get right (cuda-ipc unmaps on close): one link per
    registration, the old one closed on a new registration and when the peer goes silent."""
    import zmq
    from disagg.control.messages import (
        PROTOCOL_VERSION,
        Decoder,
        LayoutInfo,
        RegisterDecode,
        Registered,
        ToDecode,
        encoder,
    )
    from kvpool import HybridPool
    from transfer.config import TransferConfig
    from transfer.endpoint import PoolEndpoint

    memory.register()
    prefill = PrefillServer(
        PrefillConfig(pool=POOL, bootstrap_bind="tcp://127.0.0.1:*", transports=("memory",), dead_after_s=1.0)
    )
    ours = prefill.endpoint.transports[0]
    receiver = PoolEndpoint(memory.MemoryTransport(), HybridPool(POOL.pool_config()), TransferConfig())
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(prefill.control_endpoint)
    try:
        for epoch in (1, 2):  # a decode that registers again (a new epoch) on the same connection
            layout = LayoutInfo(prefill.layout.page_size, prefill.layout.layout, receiver.buffers)
            sock.send(
                encoder.encode(
                    RegisterDecode(PROTOCOL_VERSION, epoch, layout, receiver.offers(), receiver.staging_info())
                )
            )
            assert sock.poll(10_000)
            reply = Decoder(ToDecode, "t").decode(sock.recv())
            assert isinstance(reply, Registered) and reply.transport == "memory"
            assert (ours.opened, ours.closed) == (epoch, epoch - 1)
        eventually(lambda: ours.closed == 2, 10, "the silent peer's link closed")
    finally:
        sock.close()
        receiver.close()
        prefill.close()
