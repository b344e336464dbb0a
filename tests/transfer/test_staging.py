"""Receiver-side scatter: hostile or broken chunk notices are refused and write nothing."""

import pytest
import torch

from kvpool import Component, HybridPool, PoolConfig, get_preset
from transfer.errors import StagingError
from transfer.leases import SlotLease
from transfer.staging import Piece, StagingArea, scatter


@pytest.fixture()
def receiver():
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=2))
    req = pool.alloc_request(20, swa_window_only=True)
    area = StagingArea(2, 4096, "cpu")
    area.buffer.random_(0, 256)
    buffers = {c: p.storage.buffers for c, p in pool.pools.items()}
    return pool, pool.index_set(req), buffers, area


def _snapshot(pool):
    return [b.clone() for p in pool.pools.values() for b in p.storage.buffers]


def test_valid_notice_lands_in_the_named_items(receiver):
    pool, dst, buffers, area = receiver
    item = buffers[Component.FULL][0].shape[1]
    scatter(0, 1, [Piece("full", 0, 2, 3, 0)], dst, buffers, area)
    got = pool.pools[Component.FULL].storage.gather(dst[Component.FULL][2:5])[0]
    assert torch.equal(got.flatten(), area.slot(1)[: 3 * item])


@pytest.mark.parametrize(
    "notice,message",
    [  # (slot, pieces)
        ((2, [Piece("full", 0, 0, 1, 0)]), "slot 2 outside"),
        ((-1, [Piece("full", 0, 0, 1, 0)]), "slot -1 outside"),
        ((0, [Piece("bogus", 0, 0, 1, 0)]), "unknown component"),
        ((0, [Piece("full", 7, 0, 1, 0)]), "no full buffer 7"),
        ((0, [Piece("full", 0, 3, 100, 0)]), "outside 5 full destination"),
        ((0, [Piece("full", 0, -1, 1, 0)]), "outside"),
        ((0, [Piece("full", 0, 0, 0, 0)]), "outside"),
        ((0, [Piece("full", 0, 0, 1, 4000)]), "outside the slot"),
        ((0, [Piece("full", 0, 0, 1, 0), Piece("swa", 0, 0, 9, 0)]), "swa destination"),
    ],
)
def test_bad_notices_are_refused_before_any_write(receiver, notice, message):
    pool, dst, buffers, area = receiver
    before = _snapshot(pool)
    with pytest.raises(StagingError, match=message):
        scatter(0, *notice, dst, buffers, area)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool)))


def test_slot_lease_is_bounded_and_refuses_double_release():
    lease = SlotLease(3)
    a = lease.acquire(2)
    b = lease.acquire(2)
    assert len(a) == 2 and len(b) == 1 and lease.acquire(1, timeout=0.0) == []
    lease.release(a)
    with pytest.raises(StagingError, match="released twice"):
        lease.release(a)
    lease.release(b)
    assert lease.available() == 3
