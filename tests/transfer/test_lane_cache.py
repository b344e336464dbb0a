"""What a TP-sliced send works out once per (peer, lanes) instead of per send: the lane
pairing's arrays and checks (transfer.plan), the lane geometry's check (LaneRuns), and the
range count from runs x lanes. Every request's own indices are still checked every time."""

import numpy as np
import pytest

from kvpool import HybridPool, Layout, PoolConfig, get_preset
from kvpool.indices import IndexSet
from transfer.buffers import buffers_of
from transfer.errors import OutOfBounds
from transfer.plan import build_plan
from transfer.reshard import pair_lanes
from transfer.tokens import Tokens, pool_lanes, span_rows
from transfer.transports.ranges import LaneRuns

TOKENS = 37  # pages of 4 and a part page


def _side(tp: tuple[int, int], layout: Layout):
    pool = HybridPool(
        PoolConfig(
            get_preset("tiny-swa"), 4, max_tokens=256, max_requests=3, layout=layout, tp_size=tp[0], tp_rank=tp[1]
        )
    )
    bufs = tuple(buffers_of(pool.buffer_descriptors()))
    return pool, bufs, pool_lanes(pool.config.model, 4, tp[0], layout, list(bufs), "side")


def _pairing(src_tp, dst_tp, layout):
    (sp, ours, sl), (dp, theirs, dl) = _side(src_tp, layout), _side(dst_tp, layout)
    mine, peer = pair_lanes(sp.config.model, sp.config.shard, dp.config.shard, sl, dl)
    return sp, dp, ours, theirs, Tokens(TOKENS, mine, peer, True)


def _with(index_set: IndexSet, component, idx) -> IndexSet:
    """`index_set` with one component's indices replaced (a request naming other pages)."""
    return IndexSet({c: (idx if c == component else index_set[c]) for c in index_set.components()})


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("src_tp,dst_tp", [((2, 1), (1, 0)), ((1, 0), (2, 1))])
def test_a_new_requests_bad_pages_are_refused_after_a_cached_pairing(src_tp, dst_tp, layout):
    sp, dp, ours, theirs, tokens = _pairing(src_tp, dst_tp, layout)
    src, dst = sp.index_set(sp.alloc_request(TOKENS)), dp.index_set(dp.alloc_request(TOKENS))
    first = build_plan(src, dst, ours, theirs, tokens)
    full = next(c for c in first.body if c.component.value == "full")
    assert build_plan(src, dst, ours, theirs, tokens).body[0].lanes is first.body[0].lanes  # the pairing: cached
    items = min(l.num_items for l in tokens.dst[full.component])
    for bad, side in ((items, "destination"), (0, "destination"), (items, "source")):
        idx = np.array((dst if side == "destination" else src)[full.component])
        idx[len(idx) // 2] = bad
        s2 = _with(src, full.component, idx) if side == "source" else src
        d2 = _with(dst, full.component, idx) if side == "destination" else dst
        with pytest.raises(OutOfBounds, match=f"full: {side} page {bad}"):
            build_plan(s2, d2, ours, theirs, tokens)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("src_tp,dst_tp", [((2, 1), (1, 0)), ((1, 0), (2, 1)), ((2, 0), (1, 0))])
def test_the_range_count_from_runs_and_lanes_is_the_flat_ranges(src_tp, dst_tp, layout):
    sp, dp, ours, theirs, tokens = _pairing(src_tp, dst_tp, layout)
    dp.alloc_request(9)  # the destination's pages start elsewhere: runs break on both sides
    src, dst = sp.index_set(sp.alloc_request(TOKENS)), dp.index_set(dp.alloc_request(TOKENS))
    for cp in build_plan(src, dst, ours, theirs, tokens).components:
        assert cp.num_ranges == len(cp.runset) == len(cp.runset.flatten()), cp.component
        assert cp.nbytes == cp.runset.nbytes
        if cp.component.value == "full":  # rows worked out where asked are the whole array's
            whole = span_rows(src[cp.component], TOKENS, 4, cp.first_position)
            assert np.array_equal(np.asarray(cp.src_idx), whole) and len(cp.src_idx) == len(whole)
            assert np.array_equal(cp.src_idx[5:23], whole[5:23]) and np.array_equal(cp.src_idx[30:99], whole[30:])


def _lane_runs(start, count, offset, *, frozen: bool):
    def ints(v):
        a = np.array(v, dtype=np.int64)
        a.setflags(write=not frozen)
        return a

    lanes = dict(
        src_offset=ints(offset),
        dst_offset=ints(offset),
        row_bytes=ints([16, 8]),
        src_region=ints([0, 0]),
        dst_region=ints([0, 0]),
        src_pitch=ints([128, 128]),
        dst_pitch=ints([128, 128]),
        src_stride=ints([16, 8]),
        dst_stride=ints([16, 8]),
    )
    return lanes, lambda **kw: LaneRuns(
        np.array(start, dtype=np.int64),
        np.array(start, dtype=np.int64),
        np.array(count, dtype=np.int64),
        **{**lanes, **kw},
        src_rows=4,
        dst_rows=4,
    )


def test_lane_runs_check_every_requests_runs_and_lanes_that_could_have_changed():
    lanes, build = _lane_runs([0, 4], [4, 2], [0, 64], frozen=True)
    build()  # good lanes: their check is remembered for these arrays
    with pytest.raises(OutOfBounds, match="run of rows leaves its page"):
        LaneRuns(np.array([2]), np.array([2]), np.array([3]), **lanes, src_rows=4, dst_rows=4)
    writable, build_w = _lane_runs([0], [1], [0, 64], frozen=False)
    build_w()
    writable["dst_offset"][1] = 100  # 100 + 3 rows x 8 + 8 > 128: outside its item
    with pytest.raises(OutOfBounds, match="destination lane lies outside its item"):
        build_w()
    base = np.array([0, 64], dtype=np.int64)
    view = base[:]  # read-only, but its bytes writable through its base: never remembered
    view.setflags(write=False)
    build(dst_offset=view)
    base[1] = 100
    with pytest.raises(OutOfBounds, match="destination lane lies outside its item"):
        build(dst_offset=view)
