"""Real Mooncake engine over TCP on loopback between this process (sender) and a peer
server process (receiver)."""

import os
import threading

import numpy as np
import pytest

from kvpool import Component, HybridPool, IndexSet, Layout, PoolConfig, get_preset
from transfer.config import Mode, TransferConfig
from transfer.errors import (Cancelled, InjectedFault, OutOfBounds, PeerUnreachable, RegistrationError, StagingError,
                             WriteFailed)
from transfer.faults import FaultPlan
from transfer.engine import MooncakeEngine
from transfer.peer_client import PeerProcess
from transfer.peer_server import digest_request
from transfer.sender import KVSender


DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")  # both sides' pools and staging areas


def _setup(peer, preset, page, layout, tokens=2048, fragment=True):
    target = peer.configure(preset, page, tokens, layout=layout.value, max_requests=4,
                            staging_slots=4, staging_slot_mib=1, device=DEVICE)
    pool = HybridPool(PoolConfig(get_preset(preset), page, max_tokens=tokens, max_requests=4, layout=layout,
                                 device=DEVICE))
    if fragment:
        np.random.default_rng(0).shuffle(pool.pages._stack[:pool.pages.num_free])
        peer.fragment(1)
    for p in pool.pools.values():
        for b in p.storage.buffers:
            b.random_(0, 256)
    return target, pool


def _send(engine, peer, target, pool, tokens, mode, transfer_id=1):
    with KVSender(engine, pool, TransferConfig(mode=mode, staging_slot_bytes=1 << 20)) as sender:
        req = pool.alloc_request(tokens)
        rid, dst = peer.alloc(tokens)
        before = peer.digest(rid, outside=True).outside
        slots = peer.expect(transfer_id, rid, want_slots=2)
        report = sender.send(target, pool.index_set(req), dst, transfer_id, slots, peer.channel)
        got = peer.digest(rid, outside=True)
        peer.release(transfer_id)
        assert got.per_component == digest_request(pool, req), "bytes differ"
        assert got.outside == before, "bytes outside the request changed"
        peer.free(rid)
        pool.free_request(req)
        return report


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-mla-nsa", "tiny-mamba", "tiny-full"])
@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_byte_exact_fragmented(engine, peer, preset, layout, mode):
    target, pool = _setup(peer, preset, 4, layout)
    report = _send(engine, peer, target, pool, 301, mode)
    assert report.mode is mode
    if mode is Mode.STAGED:
        assert report.chunks >= 1 and report.ranges == report.chunks + 1  # chunks + the AUX row
    counts = peer.available()
    assert counts.staging_free == 4


def test_contiguous_pages_collapse_into_few_ranges(engine, peer):
    target, pool = _setup(peer, "tiny-full", 4, Layout.PAGE_MAJOR, fragment=False)
    report = _send(engine, peer, target, pool, 400, Mode.DIRECT)
    assert report.ranges == 2  # one run of 100 pages + the AUX row


def test_auto_mode_uses_the_cost_model(engine, peer):
    target, pool = _setup(peer, "tiny-full", 1, Layout.LAYER_MAJOR)
    assert _send(engine, peer, target, pool, 1500, Mode.AUTO).mode is Mode.STAGED
    target, pool = _setup(peer, "tiny-full", 64, Layout.PAGE_MAJOR, tokens=8192, fragment=False)
    assert _send(engine, peer, target, pool, 1500, Mode.AUTO).mode is Mode.DIRECT  # one run: one range


def test_more_ranges_than_the_engine_queue_holds(engine, peer):
    """5000 single-page ranges in one write: Mooncake alone rejects beyond ~2048 in flight."""
    target, pool = _setup(peer, "tiny-full", 1, Layout.PAGE_MAJOR, tokens=12000)
    report = _send(engine, peer, target, pool, 5000, Mode.DIRECT)
    assert report.ranges > 4500


def test_concurrent_senders_share_the_per_peer_budget(engine, peer):
    target, pool = _setup(peer, "tiny-full", 1, Layout.PAGE_MAJOR, tokens=16000)
    reqs, dsts, rids = [], [], []
    for _ in range(4):
        reqs.append(pool.alloc_request(1800))
        rid, dst = peer.alloc(1800)
        rids.append(rid)
        dsts.append(dst)
    errors = []
    with KVSender(engine, pool, TransferConfig(mode=Mode.DIRECT)) as sender:
        def run(i):
            try:
                sender.send(target, pool.index_set(reqs[i]), dsts[i], i)
            except Exception as exc:  # collected and asserted below
                errors.append(exc)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors
    for req, rid in zip(reqs, rids):
        assert peer.digest(rid).per_component == digest_request(pool, req)


def test_out_of_bounds_plan_is_refused_before_a_byte_moves(engine, peer):
    target, pool = _setup(peer, "tiny-hybrid", 4, Layout.PAGE_MAJOR)
    req = pool.alloc_request(40)
    rid, dst = peer.alloc(40)
    before = peer.digest(rid, outside=True)
    bad = dict(dst.by_component)
    bad[Component.MAMBA] = np.array([9999], dtype=np.int32)
    with KVSender(engine, pool, TransferConfig(mode=Mode.DIRECT)) as sender:
        with pytest.raises(OutOfBounds, match="mamba: destination index 9999"):
            sender.send(target, pool.index_set(req), IndexSet(bad))
    after = peer.digest(rid, outside=True)
    assert after.per_component == before.per_component and after.outside == before.outside


def test_engine_errors_become_typed_exceptions(engine, peer):
    target, pool = _setup(peer, "tiny-full", 4, Layout.PAGE_MAJOR)
    with KVSender(engine, pool, TransferConfig()) as sender:
        src = pool.buffer_descriptors()[0]
        far = np.array([target.descriptors[0].ptr + target.descriptors[0].nbytes + (1 << 30)], dtype=np.int64)
        with pytest.raises(WriteFailed) as err:
            engine.write(target.session_id, np.array([src.ptr], dtype=np.int64), far, np.array([4096], dtype=np.int64))
        assert err.value.code < 0 and err.value.peer == target.session_id and err.value.nbytes == 4096
        assert target.session_id in str(err.value)
        # the peer is still healthy afterwards, and so is the session
        engine.probe(target.session_id)
        _send(engine, peer, target, pool, 64, Mode.DIRECT)
        with pytest.raises(RegistrationError, match="another length"):
            engine.register([(src.ptr, src.nbytes - 64)])
        with pytest.raises(RegistrationError, match="never registered"):
            engine.unregister([12345])


def test_dead_peer_fails_writes_and_probe():
    engine = MooncakeEngine("127.0.0.1")
    with PeerProcess("tiny-full", 4, 1024) as victim:
        target = victim.target()
        pool = HybridPool(PoolConfig(get_preset("tiny-full"), 4, max_tokens=1024, max_requests=2, device=DEVICE))
        with KVSender(engine, pool, TransferConfig(mode=Mode.DIRECT)) as sender:
            req = pool.alloc_request(100)
            rid, dst = victim.alloc(100)
            sender.send(target, pool.index_set(req), dst)  # a working session first
            victim.proc.kill()
            victim.proc.wait()
            with pytest.raises(WriteFailed):
                sender.send(target, pool.index_set(req), dst)
            with pytest.raises(PeerUnreachable):
                engine.probe(target.session_id)


def test_staged_failure_releases_every_slot(engine, peer):
    """The receiver never heard of this transfer: it refuses the chunks, the sender times out
    with StagingError, and both sides' staging slots are back."""
    target, pool = _setup(peer, "tiny-full", 1, Layout.LAYER_MAJOR)
    req = pool.alloc_request(600)
    rid, dst = peer.alloc(600)
    slots = peer.expect(5, rid, want_slots=2)
    peer.release(5)  # forgotten on the receiver, but we still use the slot numbers
    with KVSender(engine, pool, TransferConfig(mode=Mode.STAGED, staging_slot_bytes=1 << 16,
                                               chunk_timeout_s=1.0)) as sender:
        with pytest.raises(StagingError, match="no ack"):
            sender.send(target, pool.index_set(req), dst, 5, slots, peer.channel)
        assert sender.staging.lease.available() == sender.config.staging_slots
    assert peer.available().staging_free == 4
    # and the peer keeps serving
    assert _send(engine, peer, target, pool, 100, Mode.STAGED).mode is Mode.STAGED


def test_staging_area_on_another_device_than_the_pool(engine, peer):
    """Host staging for the pool's device (on a CPU machine both are the CPU: the path still
    runs through the separate-device branch check)."""
    target, pool = _setup(peer, "tiny-hybrid", 4, Layout.LAYER_MAJOR)
    with KVSender(engine, pool, TransferConfig(mode=Mode.STAGED, staging_slot_bytes=1 << 20,
                                               staging_device="cpu")) as sender:
        assert sender.staging.buffer.device.type == "cpu"
        req = pool.alloc_request(77)
        rid, dst = peer.alloc(77)
        slots = peer.expect(9, rid, want_slots=2)
        sender.send(target, pool.index_set(req), dst, 9, slots, peer.channel)
        peer.release(9)
        assert peer.digest(rid).per_component == digest_request(pool, req)


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_a_stopped_send_ends_before_its_next_write(engine, peer, mode):
    """An aborted request: the sender asks `stopped()` before each write, raises Cancelled,
    writes nothing more (never the AUX row that would mark the KV complete), frees its slots."""
    target, pool = _setup(peer, "tiny-hybrid", 1, Layout.PAGE_MAJOR)
    req = pool.alloc_request(900)
    rid, dst = peer.alloc(900)
    before = peer.digest(rid, outside=True)
    slots = peer.expect(7, rid, want_slots=2)
    asked = []

    def stopped():  # the request is aborted once the first write went out
        asked.append(1)
        return len(asked) > 1

    config = TransferConfig(mode=mode, staging_slot_bytes=1 << 16)
    with KVSender(engine, pool, config) as sender:
        with pytest.raises(Cancelled, match="aborted"):
            sender.send(target, pool.index_set(req), dst, 7, slots, peer.channel, stopped=stopped)
        assert sender.staging.lease.available() == config.staging_slots
    peer.release(7)
    after = peer.digest(rid, outside=True)
    assert after.outside == before.outside, "a write landed outside the request"
    assert after.per_component["aux"] == before.per_component["aux"], "AUX written"
    assert len(asked) == 2


def test_an_injected_write_fault_fails_the_send_with_a_typed_error(engine, peer):
    target, pool = _setup(peer, "tiny-full", 4, Layout.PAGE_MAJOR)
    req = pool.alloc_request(64)
    rid, dst = peer.alloc(64)
    config = TransferConfig(mode=Mode.DIRECT, faults=FaultPlan({"send.write": 1.0}))
    with KVSender(engine, pool, config) as sender:
        with pytest.raises(InjectedFault, match="send.write"):
            sender.send(target, pool.index_set(req), dst)
        assert sender.faults.fired == {"send.write": 1}
    peer.free(rid)
    assert _send(engine, peer, target, pool, 64, Mode.DIRECT).mode is Mode.DIRECT


def test_an_aborted_staged_send_stops_waiting_for_acks(engine, peer):
    """The receiver stops acking an aborted transfer: the sender must not sit out the whole
    chunk timeout (30 s here) holding its pages and a transfer worker."""
    import time
    target, pool = _setup(peer, "tiny-full", 1, Layout.LAYER_MAJOR)
    req = pool.alloc_request(600)
    rid, dst = peer.alloc(600)
    slots = peer.expect(8, rid, want_slots=2)
    peer.release(8)   # the receiver forgot it: no acks will come
    aborted_at = time.monotonic() + 0.5
    config = TransferConfig(mode=Mode.STAGED, staging_slot_bytes=1 << 16, chunk_timeout_s=30.0)
    with KVSender(engine, pool, config) as sender:
        with pytest.raises(Cancelled, match="waiting for an ack"):
            sender.send(target, pool.index_set(req), dst, 8, slots, peer.channel,
                        stopped=lambda: time.monotonic() > aborted_at)
        assert time.monotonic() - aborted_at < 5
        assert sender.staging.lease.available() == config.staging_slots
    peer.free(rid)
    pool.free_request(req)
