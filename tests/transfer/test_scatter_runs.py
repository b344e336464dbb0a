"""A staged chunk's by-token pieces scattered as runs (transfer.staging.scatter): the pieces one
band of the receiver's lanes moves in one go (the same positions, the band's next lanes, back
to back in the slot) are checked and copied as one, and a bad piece anywhere in a run still
refuses the whole notice before any write (issue 40: TP 8 -> 1 sends 72 pieces a chunk, and
checking each on its own held decode's GIL ~1.3 ms a chunk)."""

import numpy as np
import pytest
import torch

import transfer.staging as staging
from kvpool import HybridPool, Layout, PoolConfig, get_preset
from kvpool.geometry import Component
from transfer.buffers import buffers_of
from transfer.errors import StagingError
from transfer.reshard import Shard, side_lanes
from transfer.staging import Piece, StagingArea, scatter
from transfer.tokens import TokenRows, pool_lanes

TOKENS = 40


@pytest.fixture()
def receiver():
    """A TP 1 tiny-swa pool and the lanes a TP 2 sender of rank 0 names: each full lane a head
    slice of its layer's row, the four in one band."""
    pool = HybridPool(PoolConfig(get_preset("tiny-swa"), 16, max_tokens=256, max_requests=2, layout=Layout.PAGE_MAJOR))
    c = pool.config
    lanes = pool_lanes(c.model, c.page_size, c.tp_size, c.layout, buffers_of(pool.buffer_descriptors()), "test")
    own = side_lanes(c.model, Shard(16, 2, 0), Shard(16, 1, 0), lanes, 1)
    req = pool.alloc_request(TOKENS)
    area = StagingArea(2, 4096, "cpu")
    area.buffer.random_(0, 256)
    buffers = {comp: p.storage.buffers for comp, p in pool.pools.items()}
    return pool, req, buffers, area, TokenRows(TOKENS, own)


def _run(own: TokenRows, first: int, count: int, offset: int = 0) -> list[Piece]:
    """Every full lane, positions [first, first + count), back to back from `offset`."""
    size = count * own.lanes[Component.FULL][0].token_bytes
    return [
        Piece("full", i, first, count, offset + i * size, by_token=True) for i in range(len(own.lanes[Component.FULL]))
    ]


def _snapshot(pool):
    return [b.clone() for p in pool.pools.values() for b in p.storage.buffers]


def test_a_run_lands_every_lane_in_the_rows_of_its_positions(receiver):
    pool, req, buffers, area, own = receiver
    pieces = _run(own, 3, 20)
    scatter(0, 1, pieces, pool.index_set(req), buffers, area, own=own)
    pages = pool.index_set(req)[Component.FULL]
    positions = np.arange(3, 23)
    rows = pages[positions // 16].astype(np.int64) * 16 + positions % 16
    for p in pieces:
        lane = own.lanes[Component.FULL][p.buffer]
        flat = buffers[Component.FULL][lane.buffer].view(-1)
        got = torch.cat([flat[a : a + lane.token_bytes] for a in lane.at(rows)])
        assert torch.equal(got, area.slot(1)[p.offset : p.offset + p.count * lane.token_bytes]), p.buffer


def test_a_run_works_out_its_rows_once(receiver, monkeypatch):
    """Four pieces of the same positions: the rows of those positions once, not per piece."""
    pool, req, buffers, area, own = receiver
    calls = []
    real = staging.rows
    monkeypatch.setattr(staging, "rows", lambda *a: calls.append(a) or real(*a))
    scatter(0, 1, _run(own, 3, 20), pool.index_set(req), buffers, area, own=own)
    assert len(calls) == 1


@pytest.mark.parametrize(
    "bad,message",
    [
        (lambda run: run, "outside the slot"),  # the run's last piece ends past the slot
        (lambda run: [*run[:2], Piece("full", 99, 3, 20, run[2].offset, by_token=True)], "no full lane 99"),
        (lambda run: [run[0], Piece("full", 1, 38, 20, run[1].offset, by_token=True)], r"positions \[38, 58\)"),
        (lambda run: [Piece("full", 0, 3, 20, 8, by_token=True), *run[1:]], "not 16-byte aligned"),
    ],
)
def test_a_bad_piece_anywhere_in_a_run_refuses_the_notice_before_any_write(receiver, bad, message):
    pool, req, buffers, area, own = receiver
    tb = own.lanes[Component.FULL][0].token_bytes
    offset = area.slot_bytes - 4 * 20 * tb + 16 if message == "outside the slot" else 0
    before = _snapshot(pool)
    with pytest.raises(StagingError, match=message):
        scatter(0, 1, bad(_run(own, 3, 20, offset)), pool.index_set(req), buffers, area, own=own)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool)))
