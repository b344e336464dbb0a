"""TP instances through the real control plane, servers in this process (real ZMQ; the memory
transport, which only works in one process): decode ranks registering with the prefill ranks
that hold their heads, and what a prefill rank refuses from a decode that lies about its rank."""

import threading

import msgspec
import numpy as np
import pytest
import zmq

from disagg.control.messages import (
    PROTOCOL_VERSION,
    Decoder,
    Heartbeat,
    LayoutInfo,
    RegisterDecode,
    Registered,
    RegisterPrefill,
    Refused,
    ToDecode,
    TransferDone,
    TransferRequest,
    encoder,
    indices_to_wire,
)
from disagg.decode.server import DecodeConfig, DecodeServer
from disagg.prefill.requests import Delivery
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.pool_settings import PoolSettings
from harness import memory
from kvpool import HybridPool
from transfer.config import TransferConfig
from transfer.endpoint import PoolEndpoint
from transfer.receiver import KVReceiver


def _pool(tp_size: int = 1, tp_rank: int = 0) -> PoolSettings:
    return PoolSettings(
        preset="tiny-swa", max_tokens=2048, max_requests=4, device="cpu", tp_size=tp_size, tp_rank=tp_rank
    )


# Prefill and decode share this process: a stall of the whole process (seconds, in the full
# suite) stops both sides' heartbeats at once, and the first to wake would call the other silent.
# No test here is about liveness (tests/faults is), so peers are judged dead only after this.
DEAD_AFTER_S = 60.0


@pytest.fixture()
def prefill():
    memory.register()
    server = PrefillServer(
        PrefillConfig(
            pool=_pool(),
            bootstrap_bind="tcp://127.0.0.1:*",
            transports=("memory",),
            dead_after_s=DEAD_AFTER_S,
        )
    )
    yield server
    server.close()


def test_two_decode_ranks_receive_their_heads_from_one_prefill_rank(prefill):
    decodes = [
        DecodeServer(
            DecodeConfig(
                pool=_pool(2, rank),
                bootstrap_addr=prefill.bootstrap_endpoint,
                transports=("memory",),
                dead_after_s=DEAD_AFTER_S,
            )
        )
        for rank in range(2)
    ]
    try:
        tokens = np.arange(40) % 97
        out: dict = {}
        threads = [threading.Thread(target=lambda: out.__setitem__("prefill", prefill.prefill(11, tokens)))]
        threads += [
            threading.Thread(target=lambda d=d, i=i: out.__setitem__(i, d.decode(11, tokens)))
            for i, d in enumerate(decodes)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert out["prefill"]["state"] == "SUCCESS" and out["prefill"]["destinations"] == 2
        for i in range(2):
            assert out[i]["state"] == "SUCCESS" and out[i]["verified"] and out[i]["senders"] == 1, out[i]
        assert out[0]["bytes"] + out[1]["bytes"] == out["prefill"]["bytes"]
        for server in (prefill, *decodes):
            assert server.available() == HybridPool(server.pool.config).available()
    finally:
        for d in decodes:
            d.close()


def _dealer(prefill):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(prefill.control_endpoint)
    return sock


def _ask(sock, msg):
    sock.send(encoder.encode(msg))
    assert sock.poll(10_000)
    return Decoder(ToDecode, "test").decode(sock.recv())


def test_a_decode_rank_that_lies_or_claims_a_taken_rank_is_refused_and_changes_nothing(prefill):
    receiver = PoolEndpoint(memory.MemoryTransport(), HybridPool(_pool(2, 0).pool_config()), TransferConfig())
    own = prefill.layout
    socks = [_dealer(prefill) for _ in range(3)]
    try:
        layout = LayoutInfo(own.page_size, own.layout, receiver.buffers, msgspec.structs.replace(own.model, tp_size=2))
        # a TP size its pool is not described at; a TP size that cannot split the model's 2 KV heads
        lie = _ask(socks[0], RegisterDecode(PROTOCOL_VERSION, 1, layout, receiver.offers(), None, tp_size=4, tp_rank=0))
        assert isinstance(lie, Refused) and "decode says TP size 4, its pool is described at TP size 2" in lie.reason
        three = msgspec.structs.replace(layout, model=msgspec.structs.replace(own.model, tp_size=3))
        odd = _ask(socks[0], RegisterDecode(PROTOCOL_VERSION, 1, three, receiver.offers(), None, tp_size=3, tp_rank=0))
        assert isinstance(odd, Refused) and "TP size 3" in odd.reason and "divis" in odd.reason, odd.reason
        # two connections both claiming decode rank 0 of 2 for one room: the second is refused
        for epoch, sock in enumerate(socks[1:], 2):
            reply = _ask(
                sock, RegisterDecode(PROTOCOL_VERSION, epoch, layout, receiver.offers(), None, tp_size=2, tp_rank=0)
            )
            assert isinstance(reply, Registered), reply
        kv = receiver.pool.alloc_request(16, swa_window_only=True)
        dst = indices_to_wire(receiver.pool.index_set(kv))
        socks[1].send(encoder.encode(TransferRequest(5, 2, 16, dst, [])))
        # one connection's messages are handled in order: its heartbeat's answer means the
        # claim above is in (the two sockets' messages otherwise race to the prefill's loop)
        assert isinstance(_ask(socks[1], Heartbeat(2)), Heartbeat)
        second = _ask(socks[2], TransferRequest(5, 3, 16, dst, []))
        assert isinstance(second, TransferDone) and not second.ok
        assert "decode rank 0 of room 5 is claimed by another connection" in second.reason
        r = prefill.requests.get(5)
        assert set(r.dests) == {0} and r.receivers == {0, 1}  # the first claim stands, rank 1 still expected
    finally:
        for sock in socks:
            sock.close()
        receiver.close()


@pytest.mark.parametrize("decode_first", [True, False])
def test_a_send_is_prepared_while_the_prompt_computes_once_decode_has_asked(prefill, decode_first, eventually):
    """Decode's TransferRequest here before the pages are allocated: the send is laid out on a
    transfer worker while the engine computes (the prefill answer says so); after compute: not."""
    decode = DecodeServer(
        DecodeConfig(
            pool=_pool(), bootstrap_addr=prefill.bootstrap_endpoint, transports=("memory",), dead_after_s=DEAD_AFTER_S
        )
    )
    try:
        tokens, out = np.arange(40) % 97, {}
        asks = threading.Thread(target=lambda: out.__setitem__("decode", decode.decode(12, tokens)))
        if decode_first:
            asks.start()
            eventually(lambda: prefill.requests.get(12) is not None, 10, "decode's TransferRequest")
            out["prefill"] = prefill.prefill(12, tokens)
        else:  # the KV is computed before decode asks: nothing to prepare ahead
            computes = threading.Thread(target=lambda: out.__setitem__("prefill", prefill.prefill(12, tokens)))
            computes.start()
            eventually(lambda: (r := prefill.requests.get(12)) is not None and r.kv is not None, 10, "computed")
            asks.start()
            computes.join(30)
        asks.join(30)
        assert out["prefill"]["state"] == "SUCCESS" and out["decode"]["verified"], out
        assert out["prefill"]["prepared_ahead"] is decode_first
        for server in (prefill, decode):
            assert server.available() == HybridPool(server.pool.config).available()
    finally:
        decode.close()


def test_a_request_aborted_while_its_jobs_wait_for_a_worker_plans_nothing(prefill, eventually):
    """Decode asked first, so the send is to be prepared while the prompt computes; every
    transfer worker of that decode is busy until the request was aborted: neither its prepare
    job nor its transfer job plans anything, both sides fail it, every page is free again."""
    decode = DecodeServer(
        DecodeConfig(
            pool=_pool(), bootstrap_addr=prefill.bootstrap_endpoint, transports=("memory",), dead_after_s=DEAD_AFTER_S
        )
    )
    release, planned, real = threading.Event(), [], prefill.sender.prepare
    prefill.sender.prepare = lambda *a, **k: (planned.append(a), real(*a, **k))[1]
    try:
        tokens, out = np.arange(40) % 97, {}
        asks = threading.Thread(target=lambda: out.__setitem__("decode", decode.decode(14, tokens)))
        asks.start()
        eventually(lambda: prefill.requests.get(14) is not None, 10, "decode's TransferRequest")
        r = prefill.requests.get(14)
        (d,) = r.dests.values()
        workers = prefill.peers.get(d.peer).workers
        for _ in range(prefill.config.transfer_workers):
            workers.submit(release.wait, 30)
        computes = threading.Thread(target=lambda: out.__setitem__("prefill", prefill.prefill(14, tokens)))
        computes.start()
        eventually(
            lambda: d.prepared is not None and d.delivery is Delivery.WRITING,
            10,
            "the prepare and transfer jobs queued",
        )
        assert prefill.requests.fail(r, "aborted while queued")
        release.set()
        computes.join(30)
        asks.join(30)
        assert out["prefill"]["state"] == "FAILED" and out["prefill"]["reason"] == "aborted while queued", out
        assert out["decode"]["state"] != "SUCCESS", out
        assert planned == []
        for server in (prefill, decode):
            assert server.available() == HybridPool(server.pool.config).available()
    finally:
        release.set()
        decode.close()


def test_every_sender_of_a_resharded_request_gets_staging_slots_of_its_own():
    """Issue 40: decode lent each sender 2 slots while they lasted and the rest none; those
    went direct, one transport range per row slice (TP 8 -> 1, gpt-oss-120b, 16 slots: 6 of
    8 senders, 59,040 ranges of 128 B each, 17-20 s). Here TP 2 -> 1 into an area of 2
    slots: each sender's share is one chunk, so each gets one slot and both send staged."""
    memory.register()
    staged = TransferConfig(mode="staged")
    full = lambda rank: PoolSettings(
        preset="tiny-full", max_tokens=2048, max_requests=4, device="cpu", tp_size=2, tp_rank=rank
    )
    ranks = [
        PrefillServer(
            PrefillConfig(
                pool=full(0),
                bootstrap_bind="tcp://127.0.0.1:*",
                transports=("memory",),
                dead_after_s=DEAD_AFTER_S,
                transfer=staged,
            )
        )
    ]
    ranks.append(
        PrefillServer(
            PrefillConfig(
                pool=full(1),
                bootstrap_bind=None,
                transports=("memory",),
                dead_after_s=DEAD_AFTER_S,
                transfer=staged,
                bootstrap_addr=ranks[0].bootstrap_endpoint,
            )
        )
    )
    decode = DecodeServer(
        DecodeConfig(
            pool=PoolSettings(preset="tiny-full", max_tokens=2048, max_requests=4, device="cpu"),
            transfer=TransferConfig(staging_slots=2),
            bootstrap_addr=ranks[0].bootstrap_endpoint,
            transports=("memory",),
            dead_after_s=DEAD_AFTER_S,
        )
    )
    try:
        tokens, out = np.arange(40) % 97, {}
        threads = [threading.Thread(target=lambda: out.__setitem__("decode", decode.decode(21, tokens)))]
        threads += [
            threading.Thread(target=lambda p=p, i=i: out.__setitem__(i, p.prefill(21, tokens)))
            for i, p in enumerate(ranks)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert out["decode"]["state"] == "SUCCESS" and out["decode"]["verified"], out["decode"]
        assert out["decode"]["senders"] == 2 and out["decode"]["mode"] == "staged", out["decode"]
        assert decode.endpoint.staging.lease.available() == 2
    finally:
        decode.close()
        for p in ranks:
            p.close()


def test_a_prefill_rank_claiming_a_page_size_no_pool_can_have_is_refused():
    """Decode builds the shard a prefill rank claims through the one page-size rule: a page
    size of 12 is a ProtocolError naming it (it used to get lanes, as if pages of 12 paired
    with ours), and a TP rank outside its size likewise."""
    from disagg.decode.instances import SenderRanks
    from disagg.errors import ProtocolError
    from kvpool import PoolConfig, get_preset

    pool = HybridPool(PoolConfig(get_preset("tiny-swa"), 4, max_tokens=256, max_requests=2, device="cpu"))
    with PoolEndpoint(memory.MemoryTransport(), pool, TransferConfig()) as endpoint:
        ranks = SenderRanks(KVReceiver(endpoint))
        good = RegisterPrefill(PROTOCOL_VERSION, 0, 1, "tcp://127.0.0.1:9", 1, LayoutInfo(8, "page_major", []))
        assert ranks.lanes(good) is not None and ranks.own == pool.config.shard
        for tp_rank, page_size, message in (
            (0, 12, "page size 12 is not a positive power of two"),
            (1, 8, "TP rank 1 of size 1"),
        ):
            bad = RegisterPrefill(
                PROTOCOL_VERSION, tp_rank, 1, "tcp://127.0.0.1:9", 1, LayoutInfo(page_size, "page_major", [])
            )
            with pytest.raises(ProtocolError, match=message):
                ranks.lanes(bad)
