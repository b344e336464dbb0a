"""A send prepared ahead (KVSender.prepare while the engine still computes the KV, then
send(prepared=) once it is final), over every transport of the conformance suite: prepare
moves nothing, what lands is the bytes present when the send starts, a send prepared for
other pages is planned again, a prepared write refuses a link closed meanwhile, and bad
indices fail at prepare."""

from contextlib import contextmanager

import numpy as np
import pytest
import torch

from harness.peer_server import digest_request, digest_tokens
from harness.source import source_pool
from kvpool import Component, IndexSet, Layout
from transfer.config import Mode, TransferConfig
from transfer.errors import OutOfBounds, PeerUnreachable
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender
from transfer.staging import RemoteSlots


def _compute(pool) -> None:
    """What the engine does after the send was laid out: every byte of the pool changes, and
    the KV is final (on a GPU: its kernels done) by the time the send is called."""
    for p in pool.pools.values():
        for b in p.storage.buffers:
            b.random_(0, 256)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-mla-nsa", "tiny-mamba"])
@pytest.mark.parametrize("pages", [(4, 4), (16, 4)])  # (prefill, decode): different ones move by token
@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_a_send_prepared_ahead_moves_the_bytes_present_when_it_starts(transport, peer, preset, layout, pages, mode):
    pool = source_pool(peer, preset, pages[0], layout, peer_page=pages[1])
    by_token = pages[0] != pages[1]
    with PoolEndpoint(transport, pool, TransferConfig(mode=mode, staging_slot_bytes=1 << 20)) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        req = pool.alloc_request(300)
        rid, dst = peer.alloc(300)
        before = peer.digest(rid, outside=True)
        slots = peer.expect(3, rid, want_slots=2)
        src = pool.index_set(req)
        prepared = sender.prepare(target, src, dst, req.num_tokens, can_stage=True)
        assert prepared.mode is mode
        assert peer.digest(rid, outside=True) == before, "prepare moved bytes"
        _compute(pool)
        report = sender.send(
            target, src, dst, RemoteSlots(3, slots, peer.channel), num_tokens=req.num_tokens, prepared=prepared
        )
        got = peer.digest(rid, outside=True, by_token=by_token)
        peer.release(3)
    assert report.prepared_ahead and report.mode is mode and report.prepare_ms > 0
    assert got.per_component == (digest_tokens if by_token else digest_request)(pool, req), "bytes differ"
    assert got.outside == before.outside, "bytes outside the request changed"
    peer.free(rid)


@contextmanager
def _direct(transport, peer, preset: str, tokens: int):
    """A direct sender connected to `peer`, one request of `tokens` allocated on both sides
    (the receiver's freed after)."""
    pool = source_pool(peer, preset, 4, Layout.PAGE_MAJOR)
    with PoolEndpoint(transport, pool, TransferConfig(mode=Mode.DIRECT)) as endpoint:
        sender = KVSender(endpoint)
        rid, dst = peer.alloc(tokens)
        try:
            yield pool, sender, peer.connect(sender), pool.alloc_request(tokens), rid, dst
        finally:
            peer.free(rid)


def test_a_send_prepared_for_other_pages_or_used_once_is_planned_again(transport, peer):
    with _direct(transport, peer, "tiny-hybrid", 100) as (pool, sender, target, req, rid, dst):
        rid2, dst2 = peer.alloc(100)
        src = pool.index_set(req)
        untouched = peer.digest(rid)
        stale = sender.prepare(target, src, dst, 100)
        report = sender.send(target, src, dst2, num_tokens=100, prepared=stale)
        assert not report.prepared_ahead
        assert peer.digest(rid2).per_component == digest_request(pool, req)
        assert peer.digest(rid) == untouched, "the stale plan's pages were written"
        again = IndexSet({c: np.array(a) for c, a in src.by_component.items()})  # equal indices, new arrays
        fresh = sender.prepare(target, again, dst, 100)
        assert sender.send(target, src, dst, num_tokens=100, prepared=fresh).prepared_ahead
        assert not sender.send(target, src, dst, num_tokens=100, prepared=fresh).prepared_ahead  # started once
        assert not sender.send(
            target, src, dst, num_tokens=100, prepared=sender.prepare(target, src, dst, 100, streamed=True)
        ).prepared_ahead  # laid out in layer groups: not this send's
        assert not sender.send(
            target, src, dst, num_tokens=99, prepared=sender.prepare(target, src, dst, 100)
        ).prepared_ahead  # planned for another length
        assert peer.digest(rid).per_component == digest_request(pool, req)
        peer.free(rid2)


def test_on_an_ordered_link_the_aux_row_goes_in_the_bodys_hand_off(transport, peer):
    """cuda-ipc (and the memory transport): one start for body and AUX row, in that order;
    Mooncake (unordered): the AUX row is its own write, started once the body landed."""
    with _direct(transport, peer, "tiny-hybrid", 100) as (pool, sender, target, req, rid, dst):
        src = pool.index_set(req)
        prepared = sender.prepare(target, src, dst, 100)
        chained = target.link.ordered
        assert (prepared.aux is None) == chained and len(prepared.writes) == 1
        assert prepared.writes[0].nbytes == (
            prepared.plan.nbytes if chained else prepared.plan.nbytes - prepared.plan.aux.nbytes
        )
        _compute(pool)
        report = sender.send(target, src, dst, num_tokens=100, prepared=prepared)
        assert report.prepared_ahead and report.nbytes == prepared.plan.nbytes
        assert peer.digest(rid).per_component == digest_request(pool, req)  # the AUX row included
        streamed = sender.prepare(target, src, dst, 100, streamed=True)
        assert streamed.aux is not None  # streamed: the AUX row waits for the engine to return


def test_the_same_pages_sent_again_land_the_new_bytes_and_an_unstarted_write_holds_nothing(transport, peer):
    """cuda-ipc keeps a link's kernel tables by content (issue 41: a layout prepared again,
    the same pages, starts from the table on the device: no pinned copy, no upload) and lays
    a body and its AUX row out in one table: each send of the same pages must still land the
    bytes present when it starts, AUX row included, and a prepared write dropped unstarted
    must not keep its table from being reused or freed."""
    with _direct(transport, peer, "tiny-hybrid", 300) as (pool, sender, target, req, rid, dst):
        src = pool.index_set(req)
        dropped = sender.prepare(target, src, dst, req.num_tokens)
        del dropped  # never started
        for _ in range(3):
            prepared = sender.prepare(target, src, dst, req.num_tokens)
            _compute(pool)
            assert sender.send(target, src, dst, num_tokens=req.num_tokens, prepared=prepared).prepared_ahead
            assert peer.digest(rid).per_component == digest_request(pool, req)  # the AUX row included
        if transport.kind == "cuda-ipc":
            tables = target.link._tables._tables
            assert len(tables) == 1 and all(t.users == 0 for _, t in tables.values())  # one layout, reused


def test_a_prepared_write_refuses_a_link_closed_before_it_starts(transport, peer):
    with _direct(transport, peer, "tiny-full", 64) as (pool, sender, target, req, rid, dst):
        before = peer.digest(rid, outside=True)
        prepared = sender.prepare(target, pool.index_set(req), dst, 64)
        target.link.close()  # the peer was lost (or re-registered) while the KV computed
        assert prepared.fits(target, pool.index_set(req), dst, False, False, 64)
        with pytest.raises(PeerUnreachable, match="the link is closed"):
            sender.send(target, pool.index_set(req), dst, num_tokens=64, prepared=prepared)
        assert peer.digest(rid, outside=True) == before
        again = peer.connect(sender)  # a new link serves the request (planned again: another link)
        sender.send(again, pool.index_set(req), dst, num_tokens=64, prepared=prepared)
        assert peer.digest(rid).per_component == digest_request(pool, req)


def test_bad_indices_fail_at_prepare(transport, peer):
    with _direct(transport, peer, "tiny-hybrid", 40) as (pool, sender, target, req, rid, dst):
        bad = dict(dst.by_component)
        bad[Component.MAMBA] = np.array([9999], dtype=np.int32)
        with pytest.raises(OutOfBounds, match="mamba: destination index 9999"):
            sender.prepare(target, pool.index_set(req), IndexSet(bad), 40)
