"""Pools of different page sizes (transfer.tokens): lanes agree with the pool's own views, the
planner's token runs, its refusals, and by-token staged pieces checked on the receiver."""

import numpy as np
import pytest
import torch

from harness import memory
from kvpool import Component, HybridPool, IndexSet, Layout, PoolConfig, get_preset
from transfer.buffers import buffers_of
from transfer.config import TransferConfig
from transfer.errors import IndexMismatch, LayoutIncompatible, OutOfBounds, StagingError
from transfer.plan import build_plan
from transfer.runs import group_runs
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender
from transfer.staging import Piece, StagingArea, scatter
from transfer.bands import band_copy, bands, split_rows
from transfer.tokens import TokenRows, Tokens, pool_lanes
from transfer.transports.ranges import LaneRuns


def _pool(preset: str, page: int, layout: Layout = Layout.PAGE_MAJOR) -> HybridPool:
    pool = HybridPool(PoolConfig(get_preset(preset), page, max_tokens=512, max_requests=4, layout=layout))
    for p in pool.pools.values():
        for b in p.storage.buffers:
            b.random_(0, 256)
    return pool


def _lanes(pool: HybridPool):
    c = pool.config
    return pool_lanes(c.model, c.page_size, c.tp_size, c.layout, buffers_of(pool.buffer_descriptors()), "test")


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-mla-nsa"])
def test_a_lane_row_is_the_bytes_of_that_token_in_the_pools_own_view(preset, layout):
    pool = _pool(preset, 4, layout)
    for c, lanes in _lanes(pool).items():
        placements = pool.pools[c].storage.packed.placements
        assert len(lanes) == len(placements)
        for lane, pl in zip(lanes, placements):
            assert lane.linear == (layout is Layout.LAYER_MAJOR or (c.per_request and len(placements) == 1))
            view = pool.layer_view(pl.segment.layer, pl.segment.part)  # [items, page, ...] typed
            flat = pool.pools[c].storage.buffers[lane.buffer].view(-1)
            for row in (1, 2) if c.per_request else (4, 5, 7, 9):  # slots; page 1 rows 0, 1, 3, page 2 row 1
                item = view[row] if c.per_request else view[row // 4, row % 4]
                want = item.contiguous().view(torch.uint8).flatten()
                at = int(lane.at(np.array([row]))[0])
                assert torch.equal(flat[at : at + lane.token_bytes], want)


def test_token_runs_end_at_either_sides_pages_only_where_rows_are_paged():
    src = np.arange(8, 24)  # pages 2..5 of 4 rows, contiguous
    dst = np.arange(32, 48)  # pages 2..3 of 8 rows, contiguous
    runs = group_runs(src, dst)
    assert runs.count.tolist() == [16]  # layer-major: rows back to back across pages
    runs = group_runs(src, dst, 4, 8)
    starts = [0, 4, 8, 12]
    assert runs.src_start.tolist() == src[starts].tolist() and runs.count.tolist() == [4, 4, 4, 4]


def _plan(src_pool, dst_pool, n, src_set=None, dst_set=None):
    sreq, dreq = src_pool.alloc_request(n), dst_pool.alloc_request(n)
    src_set = src_set or src_pool.index_set(sreq)
    dst_set = dst_set or dst_pool.index_set(dreq)
    return build_plan(
        src_set,
        dst_set,
        buffers_of(src_pool.buffer_descriptors()),
        buffers_of(dst_pool.buffer_descriptors()),
        Tokens(n, _lanes(src_pool), _lanes(dst_pool)),
    )


def test_the_plan_moves_what_both_sides_cover_in_runs_that_never_cross_a_page():
    src, dst = _pool("tiny-hybrid", 4), _pool("tiny-hybrid", 16)
    plan = _plan(src, dst, 45)
    full = next(c for c in plan.body if c.component is Component.FULL)
    assert full.by_token and full.first_position == 0 and len(full.src_idx) == 45
    ends = full.runs.src_start + full.runs.count - 1
    assert (full.runs.src_start // 4 == ends // 4).all()  # inside one source page
    assert (full.runs.dst_start // 16 == (full.runs.dst_start + full.runs.count - 1) // 16).all()
    swa = next(c for c in plan.body if c.component is Component.SWA)
    window = src.config.model.swa.window
    assert swa.first_position <= 45 - window  # the whole window moves
    mamba = next(c for c in plan.body if c.component is Component.MAMBA)
    assert not mamba.by_token and len(mamba.src_idx) == 1  # state slots: as items


def test_refusals_name_the_problem_before_anything_moves():
    src, dst = _pool("tiny-hybrid", 4), _pool("tiny-hybrid", 16)
    sreq, dreq = src.alloc_request(40), dst.alloc_request(40)
    s, d = src.index_set(sreq), dst.index_set(dreq)
    short = IndexSet({**d.by_component, Component.FULL: d[Component.FULL][:-1]})
    with pytest.raises(IndexMismatch, match="must each cover all 40 tokens"):
        _plan(src, dst, 40, s, short)
    long = IndexSet({**d.by_component, Component.FULL: np.concatenate([d[Component.FULL], [5, 6]]).astype(np.int32)})
    with pytest.raises(IndexMismatch, match="at most 3"):
        _plan(src, dst, 40, s, long)
    sentinel = IndexSet({**d.by_component, Component.FULL: np.zeros(3, dtype=np.int32)})
    with pytest.raises(OutOfBounds, match="destination page 0"):
        _plan(src, dst, 40, s, sentinel)


def test_a_peer_whose_buffers_are_not_our_model_at_its_page_size_is_refused_at_connect():
    src = _pool("tiny-hybrid", 4)
    with PoolEndpoint(memory.MemoryTransport(), src, TransferConfig()) as endpoint:
        sender = KVSender(endpoint)
        other = _pool("tiny-swa", 16)  # another model's buffers
        with pytest.raises(LayoutIncompatible, match="component sets differ|are not those of"):
            sender.connect([], buffers_of(other.buffer_descriptors()), None, 16)
        for bad in (0, -4, 12):
            with pytest.raises(LayoutIncompatible, match="not a positive power of two"):
                sender.connect([], buffers_of(other.buffer_descriptors()), None, bad)
        lying = _pool("tiny-hybrid", 8)  # our model, but at 8, claiming 16
        with pytest.raises(LayoutIncompatible, match="not those of tiny-hybrid at page size 16"):
            sender.connect([], buffers_of(lying.buffer_descriptors()), None, 16)


@pytest.fixture()
def receiver():
    pool = _pool("tiny-hybrid", 16)
    req = pool.alloc_request(40, swa_window_only=True)
    area = StagingArea(2, 4096, "cpu")
    area.buffer.random_(0, 256)
    buffers = {c: p.storage.buffers for c, p in pool.pools.items()}
    return pool, req, buffers, area, TokenRows(40, {c: l for c, l in _lanes(pool).items() if not c.per_request})


def test_a_by_token_piece_lands_in_the_rows_of_its_positions(receiver):
    pool, req, buffers, area, own = receiver
    lane = own.lanes[Component.FULL][1]
    scatter(0, 1, [Piece("full", 1, 17, 3, 0, by_token=True)], pool.index_set(req), buffers, area, own=own)
    rows = pool.index_set(req)[Component.FULL][1] * 16 + np.arange(1, 4)  # positions 17..19: page 1, slots 1..3
    flat = buffers[Component.FULL][lane.buffer].view(-1)
    got = torch.cat([flat[a : a + lane.token_bytes] for a in lane.at(rows)])
    assert torch.equal(got, area.slot(1)[: 3 * lane.token_bytes])


def test_rows_move_between_slots_of_any_alignment(receiver):
    """A slot whose base is not 8-byte aligned (a slot size that is not a multiple of 8):
    the rows move as narrower words, not as a misaligned int64 view."""
    pool, req, buffers, _, own = receiver
    area = StagingArea(2, 4100, "cpu")
    area.buffer.random_(0, 256)
    lane = own.lanes[Component.FULL][0]
    scatter(0, 1, [Piece("full", 0, 3, 2, 0, by_token=True)], pool.index_set(req), buffers, area, own=own)
    out = torch.zeros(2 * lane.token_bytes + 4, dtype=torch.uint8)[4:]  # misaligned on purpose
    rows = pool.index_set(req)[Component.FULL][0] * 16 + np.arange(3, 5)
    [band] = bands((lane,), [buffers[Component.FULL][lane.buffer]])
    band_copy(band, slice(0, 1), rows, split_rows(rows, 16), out, into_pool=False)
    assert torch.equal(out, area.slot(1)[: 2 * lane.token_bytes])


def _snapshot(pool):
    return [b.clone() for p in pool.pools.values() for b in p.storage.buffers]


@pytest.mark.parametrize(
    "pieces,message",
    [
        ([Piece("full", 99, 0, 1, 0, by_token=True)], "no full lane 99"),
        ([Piece("full", 0, 38, 5, 0, by_token=True)], r"positions \[38, 43\) outside"),
        ([Piece("full", 0, -1, 1, 0, by_token=True)], "outside"),
        ([Piece("full", 0, 0, 0, 0, by_token=True)], "outside"),
        ([Piece("swa", 0, 0, 1, 0, by_token=True)], r"outside the swa positions \[32, 40\)"),  # before the window
        ([Piece("full", 0, 0, 2, 4090, by_token=True)], "outside the slot"),
        (
            [Piece("full", 1, 17, 3, 0, by_token=True), Piece("full", 0, 20, 1, 100, by_token=True)],
            "not 16-byte aligned",
        ),
        ([Piece("mamba", 0, 0, 1, 0, by_token=True)], "no mamba lane"),
        ([Piece("full", 0, 0, 1, 0, by_token=True), Piece("full", 0, 39, 2, 0, by_token=True)], "outside"),
    ],
)
def test_hostile_by_token_pieces_are_refused_before_any_write(receiver, pieces, message):
    pool, req, buffers, area, own = receiver
    before = _snapshot(pool)
    with pytest.raises(StagingError, match=message):
        scatter(0, 0, pieces, pool.index_set(req), buffers, area, own=own)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(pool)))
    with pytest.raises(StagingError, match="page size is the sender's"):  # no token rows here
        scatter(0, 0, [Piece("full", 0, 0, 1, 0, by_token=True)], pool.index_set(req), buffers, area)


def test_lane_runs_refuse_runs_that_leave_a_page_and_lanes_outside_their_item():
    def runs(src_start, count, offset=(0, 48), row=(16, 8), pitch=128, rows=4, stride=None):
        ints = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
        stride = stride or row
        return LaneRuns(
            ints(src_start),
            ints(src_start),
            ints(count),
            ints(offset),
            ints(offset),
            ints(row),
            ints([0, 0]),
            ints([0, 0]),
            ints([pitch] * 2),
            ints([pitch] * 2),
            ints(stride),
            ints(stride),
            rows,
            rows,
        )

    ok = runs([4, 9], [4, 2])  # page 1 whole, page 2 rows 1..2
    flat = ok.flatten()
    assert flat.src_off.tolist() == [128, 256 + 16, 128 + 48, 256 + 48 + 8]
    assert flat.length.tolist() == [64, 32, 32, 16] and ok.nbytes == 6 * 24
    assert [e.tolist() for e in ok.extents()] == [[384, 384], [384, 384]]
    # a TP slice: 4 of lane 1's 8-byte rows 16 bytes apart -> one range per row
    sliced = runs([4, 9], [4, 2], offset=(0, 48), row=(16, 4), stride=(16, 16))
    flat = sliced.flatten()
    assert len(sliced) == 2 + 6 and flat.length.tolist() == [64, 32] + [4] * 6
    assert flat.src_off.tolist()[2:] == [128 + 48, 128 + 64, 128 + 80, 128 + 96, 256 + 48 + 16, 256 + 48 + 32]
    with pytest.raises(OutOfBounds, match="outside its item"):
        runs([4], [1], row=(16, 4), stride=(16, 28))  # 48 + 3 x 28 + 4 > 128
    with pytest.raises(OutOfBounds, match="leaves its page"):
        runs([6], [3])  # rows 6..8: page 1 into page 2
    with pytest.raises(OutOfBounds, match="outside its item"):
        runs([4], [1], offset=(0, 100))  # 100 + 4 rows x 8 B > 128


# ---- the planner's page-by-page shortcuts against the per-position definitions ----------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from transfer.runs import segment_runs  # noqa: E402
from transfer.plan import _row_runs  # noqa: E402
from transfer.tokens import SpanRows, rows, span_rows  # noqa: E402


@st.composite
def _spans(draw):
    """A request of n tokens on two sides of power-of-two page sizes, each side's pages a
    shuffled subset of a pool's (sometimes consecutive, so runs merge), covering its last
    pages, and a first position that is a multiple of the smaller page size."""
    ps, pd = (1 << draw(st.integers(0, 6)) for _ in range(2))
    n = draw(st.integers(1, 700))
    sides = []
    for p in (ps, pd):
        pages = -(-n // p)
        keep = draw(st.integers(1, pages))  # the last `keep` pages (a window), or all
        pool = np.arange(1, 4 * pages + 2)
        idx = (
            pool[:keep]
            if draw(st.booleans())
            else np.random.default_rng(draw(st.integers(0, 9))).permutation(pool)[:keep]
        )
        sides.append((idx.astype(np.int32), p, (pages - keep) * p))
    m = min(ps, pd)
    covered = max(sides[0][2], sides[1][2])
    first = min(n, -(-max(covered, draw(st.integers(0, n))) // m) * m)
    return n, sides, first, m


@settings(max_examples=300, deadline=None)
@given(_spans(), st.booleans())
def test_page_by_page_rows_and_runs_are_the_per_position_ones(span, paged):
    n, ((si, ps, _), (di, pd, _)), first, m = span
    positions = np.arange(first, n, dtype=np.int64)
    s, d = span_rows(si, n, ps, first), span_rows(di, n, pd, first)
    assert np.array_equal(s, rows(si, n, ps, positions)) and np.array_equal(d, rows(di, n, pd, positions))
    want = group_runs(s, d, *((ps, pd) if paged else ()))
    at = np.arange(first, n, m, dtype=np.int64)
    s_at, d_at = SpanRows.of(si, n, ps, first).at(at), SpanRows.of(di, n, pd, first).at(at)
    assert np.array_equal(s_at, s[at - first]) and np.array_equal(d_at, d[at - first])
    got = segment_runs(s_at, d_at, np.minimum(m, n - at), paged)
    sides = SpanRows.of(si, n, ps, first), SpanRows.of(di, n, pd, first)
    assert np.array_equal(sides[0].starts(m), s_at) and np.array_equal(sides[1].starts(m), d_at)
    planned = _row_runs(*sides, paged)  # (from starts(): a side's pages' first rows where it can)
    for f in ("src_start", "dst_start", "count"):
        assert np.array_equal(getattr(got, f), getattr(want, f)), f
        assert np.array_equal(getattr(planned, f), getattr(want, f)), f
