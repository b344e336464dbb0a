"""Sender/receiver conformance: the real Mooncake engine over TCP on loopback between this
process (sender) and a peer server process (receiver), and the same tests over the fake
in-process memory transport (the `kind` fixture), which proves the transport seam."""

import os
import re
import signal
import threading

import numpy as np
import pytest
import torch

from kvpool import Component, HybridPool, IndexSet, Layout, PoolConfig, get_preset
from transfer.config import Mode, TransferConfig
from harness.peer_client import PeerProcess
from harness.peer_server import digest_request
from harness.source import DEVICE, send_checked, source_pool
from transfer.errors import (
    Cancelled,
    InjectedFault,
    OutOfBounds,
    PeerUnreachable,
    RegistrationError,
    StagingError,
    TransportError,
    WriteFailed,
)
from transfer.faults import FaultPlan
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender
from transfer.transports import Ranges, TransportSettings, create
from transfer.staging import RemoteSlots


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-mla-nsa", "tiny-mamba", "tiny-full"])
@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_byte_exact_fragmented(transport, peer, preset, layout, mode):
    pool = source_pool(peer, preset, 4, layout)
    report = send_checked(transport, peer, pool, 301, mode)
    assert report.mode is mode and report.transport == transport.kind
    if mode is Mode.STAGED:
        assert report.chunks >= 1 and report.ranges == report.chunks + 1  # chunks + the AUX row
    counts = peer.available()
    assert counts.staging_free == 4


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("pages", [(4, 16), (16, 4), (1, 16), (16, 1)])  # (prefill, decode)
@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-mla-nsa", "tiny-mamba"])
@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_byte_exact_across_page_sizes(transport, peer, preset, pages, layout, mode):
    """Pools of different page sizes: every token position the receiver holds (SWA: the
    window) arrives byte for byte, state and AUX as items, nothing outside the request."""
    pool = source_pool(peer, preset, pages[0], layout, peer_page=pages[1])
    report = send_checked(transport, peer, pool, 301, mode, by_token=True)
    assert report.mode is mode
    assert peer.available().staging_free == 4


@pytest.mark.parametrize("pages", [(4, 4), (4, 16)])
def test_a_chunk_size_below_the_slot_sends_that_many_more_chunks(transport, peer, pages):
    """staging_chunk_bytes (prefill's --staging-chunk-kib) cuts a staged send into chunks of
    at most that size, through the same two receiver slots, byte for byte; one below the
    largest item moves whole items (none split) and one above the slot moves a slot's."""
    by_token = pages[0] != pages[1]
    pool = source_pool(peer, "tiny-hybrid", pages[0], Layout.PAGE_MAJOR, peer_page=pages[1])
    whole = send_checked(transport, peer, pool, 301, Mode.STAGED, by_token=by_token)
    nbytes = whole.nbytes
    assert whole.chunks == -(-nbytes // (1 << 20))  # (the 1 MiB slots of _send)
    cut = send_checked(transport, peer, pool, 301, Mode.STAGED, by_token=by_token, chunk_bytes=nbytes // 6)
    assert cut.nbytes == nbytes and 6 <= cut.chunks <= 9 and cut.ranges == cut.chunks + 1
    tiny = send_checked(transport, peer, pool, 301, Mode.STAGED, by_token=by_token, chunk_bytes=1)
    assert tiny.nbytes == nbytes and tiny.chunks > cut.chunks  # an item (a page's row or one token's) each
    big = send_checked(transport, peer, pool, 301, Mode.STAGED, by_token=by_token, chunk_bytes=64 << 20)
    assert big.chunks == whole.chunks
    assert peer.available().staging_free == 4


def test_contiguous_pages_collapse_into_few_ranges(transport, peer):
    pool = source_pool(peer, "tiny-full", 4, Layout.PAGE_MAJOR, fragment=False)
    report = send_checked(transport, peer, pool, 400, Mode.DIRECT)
    assert report.ranges == 2  # one run of 100 pages + the AUX row


def test_auto_mode_uses_the_cost_model(mooncake):
    with PeerProcess("tiny-full", 4, 4096) as peer:
        pool = source_pool(peer, "tiny-full", 1, Layout.LAYER_MAJOR)
        assert send_checked(mooncake, peer, pool, 1500, Mode.AUTO).mode is Mode.STAGED
        pool = source_pool(peer, "tiny-full", 64, Layout.PAGE_MAJOR, tokens=8192, fragment=False)
        assert send_checked(mooncake, peer, pool, 1500, Mode.AUTO).mode is Mode.DIRECT  # one run: one range


def test_more_ranges_than_the_engine_queue_holds(transport, peer):
    """5000 single-page ranges in one write: Mooncake alone rejects beyond ~2048 in flight."""
    pool = source_pool(peer, "tiny-full", 1, Layout.PAGE_MAJOR, tokens=12000)
    report = send_checked(transport, peer, pool, 5000, Mode.DIRECT)
    assert report.ranges > 4500


def test_concurrent_senders_share_the_per_peer_budget(transport, peer):
    pool = source_pool(peer, "tiny-full", 1, Layout.PAGE_MAJOR, tokens=16000)
    reqs, dsts, rids = [], [], []
    for _ in range(4):
        reqs.append(pool.alloc_request(1800))
        rid, dst = peer.alloc(1800)
        rids.append(rid)
        dsts.append(dst)
    errors = []
    with PoolEndpoint(transport, pool, TransferConfig(mode=Mode.DIRECT)) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)

        def run(i):
            try:
                sender.send(target, pool.index_set(reqs[i]), dsts[i])
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


def test_out_of_bounds_plan_is_refused_before_a_byte_moves(transport, peer):
    pool = source_pool(peer, "tiny-hybrid", 4, Layout.PAGE_MAJOR)
    req = pool.alloc_request(40)
    rid, dst = peer.alloc(40)
    before = peer.digest(rid, outside=True)
    bad = dict(dst.by_component)
    bad[Component.MAMBA] = np.array([9999], dtype=np.int32)
    with PoolEndpoint(transport, pool, TransferConfig(mode=Mode.DIRECT)) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        with pytest.raises(OutOfBounds, match="mamba: destination index 9999"):
            sender.send(target, pool.index_set(req), IndexSet(bad))
        # the link refuses a range outside the peer's regions, whatever the planner said
        far = target.buffers[0].nbytes
        with pytest.raises(OutOfBounds, match="outside the"):
            target.link.write(Ranges.one(0, 0, 0, far, 64))
        with pytest.raises(OutOfBounds, match="outside the"):
            target.link.write(Ranges.one(0, 0, 99, 0, 64))
    after = peer.digest(rid, outside=True)
    assert after.per_component == before.per_component and after.outside == before.outside


def test_engine_errors_become_typed_exceptions(mooncake):
    """A Mooncake failure (here: an offer whose regions lie about their size, so the engine
    itself refuses the write) is a WriteFailed naming the peer, the bytes and the code."""
    import msgspec
    from transfer.transports import Offer
    from transfer.transports.mooncake import _Blob

    with PeerProcess("tiny-full", 4, 1024) as peer:
        pool = source_pool(peer, "tiny-full", 4, Layout.PAGE_MAJOR)
        with PoolEndpoint(mooncake, pool, TransferConfig()) as endpoint:
            sender = KVSender(endpoint)
            t = peer.target()
            blob = msgspec.msgpack.decode(t.offers[0].blob, type=_Blob)
            lying = _Blob(blob.session, [(p, n + (1 << 31)) for p, n in blob.regions])
            offer = Offer("mooncake", t.offers[0].host, msgspec.msgpack.encode(lying))
            target = sender.connect([offer], t.buffers, t.staging)
            with pytest.raises(WriteFailed) as err:
                target.link.write(Ranges.one(0, 0, 0, blob.regions[0][1] + (1 << 30), 4096))
            assert err.value.code < 0 and err.value.peer == blob.session and err.value.nbytes == 4096
            assert blob.session in str(err.value)
            target.link.probe()  # the peer and the session are still healthy afterwards
            send_checked(mooncake, peer, pool, 64, Mode.DIRECT)
            src = pool.buffer_descriptors()[0]
            with pytest.raises(RegistrationError, match="another length"):
                mooncake.expose([(src.ptr, src.nbytes - 64)])


def test_dead_peer_fails_writes_and_probe():
    [transport] = create(["mooncake"], TransportSettings("127.0.0.1"))
    with PeerProcess("tiny-full", 4, 1024) as victim:
        pool = HybridPool(PoolConfig(get_preset("tiny-full"), 4, max_tokens=1024, max_requests=2, device=DEVICE))
        with PoolEndpoint(transport, pool, TransferConfig(mode=Mode.DIRECT)) as endpoint:
            sender = KVSender(endpoint)
            target = victim.connect(sender)
            req = pool.alloc_request(100)
            rid, dst = victim.alloc(100)
            sender.send(target, pool.index_set(req), dst)  # a working session first
            victim.proc.kill()
            victim.proc.wait()
            with pytest.raises(WriteFailed):
                sender.send(target, pool.index_set(req), dst)
            with pytest.raises(PeerUnreachable):
                target.link.probe()


def _linked(transport, peer: PeerProcess):
    """(source bytes as large as the peer's first buffer, their exposure, a link to that buffer),
    the link's session made by one write first."""
    t = peer.target()
    size = int(t.buffers[0].nbytes) // 64 * 64
    src = torch.randint(0, 256, (size,), dtype=torch.uint8)
    exposure = transport.expose([(src.data_ptr(), size)])
    link = transport.connect(t.offers[0], exposure)
    link.write(Ranges.one(0, 0, 0, 0, 4096), timeout=30)
    return src, exposure, link


def test_closing_the_link_of_a_frozen_peer_abandons_its_writes_and_a_thawed_peer_is_served(eventually):
    """Mooncake leaves writes to a frozen (SIGSTOPped) peer pending for as long as it is frozen.
    Closing the link (prefill dropped the peer) ends their waits at once; the reaper keeps the
    ranges already in the engine and returns the peer's budget once they end (after the thaw),
    so the same peer, registered again, is served."""
    [transport] = create(["mooncake"], TransportSettings("127.0.0.1"))
    try:
        with PeerProcess("tiny-full", 4, 131072) as frozen:
            src, exposure, link = _linked(transport, frozen)
            size = src.numel()
            n = 64
            at = np.arange(n, dtype=np.int64) * (size // n)
            zero = np.zeros(n, dtype=np.int64)
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            try:
                write = link.write_async(Ranges(zero, at, zero, at, np.full(n, size // n, dtype=np.int64)))
                budget = transport._budget(link.peer)
                assert budget.inflight > 0 and not write.ended
                link.close()
                with pytest.raises(PeerUnreachable, match="abandoned"):
                    write.wait(timeout=5)
                with pytest.raises(PeerUnreachable, match="closed"):
                    link.write_async(Ranges.one(0, 0, 0, 0, 4096))
                assert len(transport.reaper) == 1 and budget.inflight > 0  # still in the engine
            finally:
                os.kill(frozen.proc.pid, signal.SIGCONT)
            eventually(
                lambda: len(transport.reaper) == 0 and budget.inflight == 0,
                30,
                "the reaper retired the abandoned ranges and returned the peer's budget",
            )
            again = transport.connect(frozen.target().offers[0], exposure)  # registered again
            again.write(Ranges.one(0, 0, 0, 0, size), timeout=30)
            exposure.close()
    finally:
        transport.close()


def test_writes_failed_into_a_frozen_peer_stay_unsettled_until_their_bytes_landed(eventually):
    """Mooncake fails the ranges of a frozen peer at its progress timeout (5 s) and closes their
    connections, but the kernel still holds what those sockets had not delivered and sends it
    once the peer thaws, into the ranges' destinations (transports/proc_tcp.py). So the
    transport is unsettled after the reaper let the ranges go, until those bytes landed."""
    [transport] = create(["mooncake"], TransportSettings("127.0.0.1"))
    try:
        with PeerProcess("tiny-full", 4, 131072) as frozen:
            src, exposure, link = _linked(transport, frozen)
            size = src.numel()
            n = 4  # one range per pooled connection: all of them stall, and fail, at once
            at = np.arange(n, dtype=np.int64) * (size // n)
            zero = np.zeros(n, dtype=np.int64)
            os.kill(frozen.proc.pid, signal.SIGSTOP)
            try:
                write = link.write_async(Ranges(zero, at, zero, at, np.full(n, size // n, dtype=np.int64)))
                link.close()
                with pytest.raises(PeerUnreachable, match="abandoned"):
                    write.wait(timeout=5)
                eventually(lambda: len(transport.reaper) == 0, 30, "Mooncake ended the abandoned ranges")
                assert transport.unsettled() > 0  # their sockets closed with bytes still in them
            finally:
                os.kill(frozen.proc.pid, signal.SIGCONT)
            eventually(lambda: transport.unsettled() == 0, 30, "the closed sockets delivered their bytes")
            exposure.close()
    finally:
        transport.close()


def test_staged_failure_releases_every_slot(transport, peer):
    """The receiver never heard of this transfer: it refuses the chunks, the sender times out
    with StagingError, and both sides' staging slots are back."""
    pool = source_pool(peer, "tiny-full", 1, Layout.LAYER_MAJOR)
    req = pool.alloc_request(600)
    rid, dst = peer.alloc(600)
    slots = peer.expect(5, rid, want_slots=2)
    peer.release(5)  # forgotten on the receiver, but we still use the slot numbers
    with PoolEndpoint(
        transport, pool, TransferConfig(mode=Mode.STAGED, staging_slot_bytes=1 << 16, chunk_timeout_s=1.0)
    ) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        # chunks 0 and 1 go into the two slots; chunk 1's notice goes once its write landed,
        # which under load may be after the wait for chunk 0's ack began: 1 or 2 told
        with pytest.raises(StagingError, match=r"no ack for chunk 0 within 1.0 s \([12] chunks told, no ack heard\)"):
            sender.send(target, pool.index_set(req), dst, RemoteSlots(5, slots, peer.channel))
        assert endpoint.staging.lease.available() == endpoint.config.staging_slots
    assert peer.available().staging_free == 4
    # and the peer keeps serving
    assert send_checked(transport, peer, pool, 100, Mode.STAGED).mode is Mode.STAGED


def test_an_ack_timeout_says_how_far_the_acks_came(transport, peer):
    """The receiver takes the first chunks, then refuses one (its request holds fewer items
    than the sender writes): the AckTimeout names the last chunk acked, so a timeout after
    acks stopped part-way (a chunk refused, a scatter stuck) reads apart from one where none
    came (a lost notice, a stopped receiver loop). Issue 40: a bench row once ended in "no
    ack for chunk 2 within 30 s" and said no more."""
    pool = source_pool(peer, "tiny-full", 1, Layout.LAYER_MAJOR)
    req = pool.alloc_request(600)
    small, _ = peer.alloc(100)
    rid, dst = peer.alloc(600)
    slots = peer.expect(6, small, want_slots=2)  # checked against 100 items: later chunks are refused
    # 5 s: the first chunks' acks must come in time on a loaded machine (1 s was once too short)
    config = TransferConfig(mode=Mode.STAGED, staging_slot_bytes=1 << 12, chunk_timeout_s=5.0)
    with PoolEndpoint(transport, pool, config) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        with pytest.raises(StagingError, match="acks heard up to") as err:
            sender.send(target, pool.index_set(req), dst, RemoteSlots(6, slots, peer.channel))
        said = re.search(
            r"no ack for chunk (\d+) within 5.0 s \((\d+) chunks told, acks heard up to chunk (\d+)\)", str(err.value)
        )
        assert said, str(err.value)
        waited, told, heard = (int(x) for x in said.groups())
        assert 0 <= heard < waited < told, str(err.value)
    peer.release(6)
    peer.free(rid)
    peer.free(small)


def test_staging_area_on_another_device_than_the_pool(transport, peer):
    """Host staging for the pool's device (on a CPU machine both are the CPU: the path still
    runs through the separate-device branch check)."""
    pool = source_pool(peer, "tiny-hybrid", 4, Layout.LAYER_MAJOR)
    config = TransferConfig(mode=Mode.STAGED, staging_slot_bytes=1 << 20, staging_device="cpu")
    if transport.kind == "cuda-ipc":  # a host staging area cannot be exposed to CUDA IPC: refused, named
        with pytest.raises(TransportError, match="not CUDA device memory"):
            PoolEndpoint(transport, pool, config)
        return
    with PoolEndpoint(transport, pool, config) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        assert endpoint.staging.buffer.device.type == "cpu"
        req = pool.alloc_request(77)
        rid, dst = peer.alloc(77)
        slots = peer.expect(9, rid, want_slots=2)
        sender.send(target, pool.index_set(req), dst, RemoteSlots(9, slots, peer.channel))
        peer.release(9)
        assert peer.digest(rid).per_component == digest_request(pool, req)


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_a_stopped_send_ends_before_its_next_write(transport, peer, mode):
    """An aborted request: the sender asks `stopped()` before each write, raises Cancelled,
    writes nothing more (never the AUX row that would mark the KV complete), frees its slots."""
    pool = source_pool(peer, "tiny-hybrid", 1, Layout.PAGE_MAJOR)
    req = pool.alloc_request(900)
    rid, dst = peer.alloc(900)
    before = peer.digest(rid, outside=True)
    slots = peer.expect(7, rid, want_slots=2)
    asked = []

    def stopped():  # the request is aborted once the first write went out
        asked.append(1)
        return len(asked) > 1

    config = TransferConfig(mode=mode, staging_slot_bytes=1 << 16)
    with PoolEndpoint(transport, pool, config) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        with pytest.raises(Cancelled, match="aborted"):
            sender.send(target, pool.index_set(req), dst, RemoteSlots(7, slots, peer.channel), stopped=stopped)
        assert endpoint.staging.lease.available() == config.staging_slots
    peer.release(7)
    after = peer.digest(rid, outside=True)
    assert after.outside == before.outside, "a write landed outside the request"
    assert after.per_component["aux"] == before.per_component["aux"], "AUX written"
    assert len(asked) == 2


def test_an_injected_write_fault_fails_the_send_with_a_typed_error(transport, peer):
    pool = source_pool(peer, "tiny-full", 4, Layout.PAGE_MAJOR)
    req = pool.alloc_request(64)
    rid, dst = peer.alloc(64)
    config = TransferConfig(mode=Mode.DIRECT, faults=FaultPlan({"send.write": 1.0}))
    with PoolEndpoint(transport, pool, config) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        with pytest.raises(InjectedFault, match="send.write"):
            sender.send(target, pool.index_set(req), dst)
        assert endpoint.faults.fired == {"send.write": 1}
    peer.free(rid)
    assert send_checked(transport, peer, pool, 64, Mode.DIRECT).mode is Mode.DIRECT


def test_an_aborted_staged_send_stops_waiting_for_acks(transport, peer):
    """The receiver stops acking an aborted transfer: the sender must not sit out the whole
    chunk timeout (30 s here) holding its pages and a transfer worker."""
    import time

    pool = source_pool(peer, "tiny-full", 1, Layout.LAYER_MAJOR)
    req = pool.alloc_request(600)
    rid, dst = peer.alloc(600)
    slots = peer.expect(8, rid, want_slots=2)
    peer.release(8)  # the receiver forgot it: no acks will come
    aborted_at = time.monotonic() + 0.5
    config = TransferConfig(mode=Mode.STAGED, staging_slot_bytes=1 << 16, chunk_timeout_s=30.0)
    with PoolEndpoint(transport, pool, config) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        with pytest.raises(Cancelled, match="waiting for an ack"):
            sender.send(
                target,
                pool.index_set(req),
                dst,
                RemoteSlots(8, slots, peer.channel),
                stopped=lambda: time.monotonic() > aborted_at,
            )
        assert time.monotonic() - aborted_at < 5
        assert endpoint.staging.lease.available() == config.staging_slots
    peer.free(rid)
    pool.free_request(req)
