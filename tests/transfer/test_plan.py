"""The planner and staging math, pure numpy: no engine, no processes."""

import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from kvpool import Component, HybridPool, IndexSet, Layout, PoolConfig, get_preset
from transfer.config import Mode, TransferConfig
from transfer.cost import choose_mode
from transfer.errors import IndexMismatch, LayoutIncompatible, OutOfBounds, StagingError
from transfer.buffers import buffers_of, layout_difference
from transfer.plan import build_plan
from transfer.runs import align, group_runs
from transfer.staging import PIECE_ALIGN, chunk_plan
from transfer.transports.mooncake import TCP_COST

index_arrays = st.lists(st.integers(1, 10_000), min_size=0, max_size=60).map(lambda v: np.array(v, dtype=np.int32))


@settings(max_examples=200, deadline=None)
@given(src=index_arrays, dst=index_arrays, component=st.sampled_from(list(Component)))
def test_align_never_mutates_and_equalizes(src, dst, component):
    src_before, dst_before = src.copy(), dst.copy()
    try:
        a, b = align(src, dst, component)
    except IndexMismatch:
        assert len(src) != len(dst) and not component.truncatable
    else:
        assert len(a) == len(b) == min(len(src), len(dst))
        assert np.array_equal(a, src[: len(a)]) and np.array_equal(b, dst[: len(b)])
        assert not a.flags.writeable and not b.flags.writeable
        assert not np.shares_memory(a, src) and not np.shares_memory(b, dst)
    assert np.array_equal(src, src_before) and np.array_equal(dst, dst_before)


def test_align_warns_with_both_lengths(caplog):
    with caplog.at_level(logging.WARNING, logger="transfer.runs"):
        a, b = align(np.arange(1, 10, dtype=np.int32), np.arange(1, 8, dtype=np.int32), Component.SWA)
    assert len(a) == len(b) == 7
    assert "9 source vs 7 destination" in caplog.text


@pytest.mark.parametrize("component", [Component.FULL, Component.MAMBA, Component.AUX])
def test_align_refuses_mismatch_where_it_would_lose_data(component):
    with pytest.raises(IndexMismatch, match="1 source vs 2 destination"):
        align(np.array([3], dtype=np.int32), np.array([4, 5], dtype=np.int32), component)


def _reference_runs(src, dst):
    runs = []
    for s, d in zip(src.tolist(), dst.tolist()):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_group_runs_matches_reference(data):
    n = data.draw(st.integers(0, 80))
    # bias towards contiguity so long runs actually occur
    steps = st.lists(st.sampled_from([1, 1, 1, 2, -3, 7]), min_size=n, max_size=n)
    src = np.cumsum(np.array([50] + data.draw(steps), dtype=np.int64))[:n]
    dst = np.cumsum(np.array([900] + data.draw(steps), dtype=np.int64))[:n]
    runs = group_runs(src, dst)
    got = [[int(a), int(b), int(c)] for a, b, c in zip(runs.src_start, runs.dst_start, runs.count)]
    assert got == _reference_runs(src, dst)
    assert int(runs.count.sum()) == n


def _pools(preset="tiny-hybrid", layout=Layout.PAGE_MAJOR, other_layout=None):
    model = get_preset(preset)
    a = HybridPool(PoolConfig(model, 4, max_tokens=512, max_requests=4, layout=layout))
    b = HybridPool(PoolConfig(model, 4, max_tokens=512, max_requests=4, layout=other_layout or layout))
    return a, b


def bufs(pool):
    return buffers_of(pool.buffer_descriptors())


@pytest.mark.parametrize("layout", list(Layout))
def test_expand_matches_a_reference_loop(layout):
    a, b = _pools(layout=layout)
    np.random.default_rng(0).shuffle(a.pages._stack[: a.pages.num_free])
    ra, rb = a.alloc_request(40), b.alloc_request(40, swa_window_only=True)
    plan = build_plan(a.index_set(ra), b.index_set(rb), bufs(a), bufs(b))
    for cp in plan.components:
        want = []
        for sb, db in zip(cp.src_bufs, cp.dst_bufs):
            for s, d in zip(cp.src_idx.tolist(), cp.dst_idx.tolist()):
                want.append((sb.region, s * sb.item_bytes, db.region, d * db.item_bytes, sb.item_bytes))
        r = cp.ranges
        got = zip(
            r.src_region.tolist(), r.src_off.tolist(), r.dst_region.tolist(), r.dst_off.tolist(), r.length.tolist()
        )
        # ranges may cover several items; expand them item by item to compare
        items = []
        for sr, so, dr, do, n in got:
            item = next(b.item_bytes for b in cp.src_bufs if b.region == sr)
            items += [(sr, so + k * item, dr, do + k * item, item) for k in range(n // item)]
        assert sorted(items) == sorted(want), cp.component
    assert plan.aux is not None and plan.components[-1] is plan.aux  # AUX last
    for cp in plan.components:  # the factorized form links take is the same set of ranges
        flat, rs = cp.ranges, cp.runset.flatten()
        assert len(rs) == len(flat) == cp.num_ranges and cp.runset.nbytes == flat.nbytes
        for f in ("src_region", "src_off", "dst_region", "dst_off", "length"):
            assert np.array_equal(getattr(flat, f), getattr(rs, f)), (cp.component, f)


def test_out_of_range_destination_index_is_refused():
    a, b = _pools()
    ra, rb = a.alloc_request(12), b.alloc_request(12)
    dst = dict(b.index_set(rb).by_component)
    bad = dst[Component.FULL].copy()
    bad[1] = b.sizes.full_pages + 1
    dst[Component.FULL] = bad
    with pytest.raises(OutOfBounds, match="destination index"):
        build_plan(a.index_set(ra), IndexSet(dst), bufs(a), bufs(b))
    dst[Component.FULL] = np.where(bad == bad[1], 0, bad).astype(np.int32)  # the sentinel is no target either
    with pytest.raises(OutOfBounds, match="outside \\[1,"):
        build_plan(a.index_set(ra), IndexSet(dst), bufs(a), bufs(b))


def test_buffer_tuples_are_grouped_and_paired_once_and_every_request_is_still_checked():
    """Issue 41: each send grouped, paired and turned into arrays the same two buffer lists
    (72 buffers compared one by one for a layer-major pool). Tuples (what KVSender passes)
    are worked out once: the arrays a plan's runsets carry are the same objects send after
    send, a refused pairing is refused every time, and a request's bad index is refused
    right after a good request planned against the same tuples."""
    a, b = _pools(layout=Layout.LAYER_MAJOR)
    ours, theirs = tuple(bufs(a)), tuple(bufs(b))
    ra, rb = a.alloc_request(12), b.alloc_request(12)
    first = build_plan(a.index_set(ra), b.index_set(rb), ours, theirs)
    again = build_plan(a.index_set(ra), b.index_set(rb), ours, theirs)
    for x, y in zip(first.components, again.components):
        assert x.src_bufs is y.src_bufs and x.runset.src_region is y.runset.src_region
        assert x.runset.item_bytes is y.runset.item_bytes and not x.runset.src_region.flags.writeable
        assert x.runset.src_region.tolist() == [buf.region for buf in x.src_bufs]
    dst = dict(b.index_set(rb).by_component)
    bad = dst[Component.FULL].copy()
    bad[-1] = b.sizes.full_pages + 1
    dst[Component.FULL] = bad
    with pytest.raises(OutOfBounds, match="full: destination index"):
        build_plan(a.index_set(ra), IndexSet(dst), ours, theirs)
    other = tuple(bufs(_pools(layout=Layout.PAGE_MAJOR)[1]))
    for _ in range(2):
        with pytest.raises(LayoutIncompatible, match="4 source buffers vs 1 destination buffers"):
            build_plan(a.index_set(ra), b.index_set(rb), ours, other)


def test_expand_checks_each_block_against_its_own_buffer():
    a, b = _pools()
    ra, rb = a.alloc_request(12), b.alloc_request(12)
    shrunk = [replace(d, nbytes=d.item_bytes * 2) if d.component is Component.FULL else d for d in bufs(b)]
    with pytest.raises(OutOfBounds):
        plan = build_plan(a.index_set(ra), b.index_set(rb), bufs(a), shrunk)
        plan.body_ranges()


def test_layouts_that_cannot_pair_are_refused_with_the_difference():
    a, b = _pools(layout=Layout.PAGE_MAJOR, other_layout=Layout.LAYER_MAJOR)
    ra, rb = a.alloc_request(12), b.alloc_request(12)
    with pytest.raises(LayoutIncompatible, match="1 source buffers vs 4 destination buffers"):
        build_plan(a.index_set(ra), b.index_set(rb), bufs(a), bufs(b))
    # the registration asks the same one check
    assert "1 source buffers vs 4 destination buffers" in layout_difference(bufs(a), bufs(b))
    assert layout_difference(bufs(a), bufs(_pools()[1])) is None
    full, mamba = _pools("tiny-full")[0], _pools("tiny-mamba")[0]
    rf, rm = full.alloc_request(12), mamba.alloc_request(12)
    with pytest.raises(LayoutIncompatible, match="lacks"):
        build_plan(full.index_set(rf), mamba.index_set(rm), bufs(full), bufs(mamba))
    assert "lacks" in layout_difference(bufs(full), bufs(mamba))


@pytest.mark.parametrize("slot_bytes", [4096, 10_000, 1 << 20])
def test_chunks_cover_every_item_once(slot_bytes):
    a, b = _pools(layout=Layout.LAYER_MAJOR)
    np.random.default_rng(1).shuffle(a.pages._stack[: a.pages.num_free])
    ra, rb = a.alloc_request(200), b.alloc_request(200)
    plan = build_plan(a.index_set(ra), b.index_set(rb), bufs(a), bufs(b))
    chunks = chunk_plan(plan.body, slot_bytes)
    seen = {}
    for ch in chunks:
        assert ch.nbytes <= slot_bytes
        spans = []
        for p in ch.pieces:
            assert p.offset % PIECE_ALIGN == 0
            item = next(cp for cp in plan.body if cp.component.value == p.component).src_bufs[p.buffer].item_bytes
            spans.append((p.offset, p.offset + p.count * item))
            seen.setdefault((p.component, p.buffer), []).append((p.first, p.count))
        spans.sort()
        assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:])), "pieces overlap in the slot"
        assert spans[-1][1] <= ch.nbytes
    for cp in plan.body:
        for b_i in range(len(cp.src_bufs)):
            parts = sorted(seen[(cp.component.value, b_i)])
            assert parts[0][0] == 0 and sum(c for _, c in parts) == len(cp.src_idx)
            assert all(f1 + c1 == f2 for (f1, c1), (f2, _) in zip(parts, parts[1:]))


def test_item_larger_than_slot_is_a_clear_error():
    a, b = _pools()
    ra, rb = a.alloc_request(12), b.alloc_request(12)
    plan = build_plan(a.index_set(ra), b.index_set(rb), bufs(a), bufs(b))
    with pytest.raises(StagingError, match="exceeds staging slot"):
        chunk_plan(plan.body, 64)


def test_cost_model_picks_what_the_measurements_say():
    cfg = TransferConfig()
    model = get_preset("gpt-oss-120b")
    for page, layout, want in [
        (16, Layout.PAGE_MAJOR, Mode.DIRECT),
        (64, Layout.PAGE_MAJOR, Mode.DIRECT),
        (1, Layout.PAGE_MAJOR, Mode.STAGED),
        (1, Layout.LAYER_MAJOR, Mode.STAGED),
        (16, Layout.LAYER_MAJOR, Mode.STAGED),
    ]:
        pools = [
            HybridPool(PoolConfig(model, page, max_tokens=8192, max_requests=2, layout=layout, device="meta"))
            for _ in range(2)
        ]
        for i, p in enumerate(pools):
            np.random.default_rng(i).shuffle(p.pages._stack[: p.pages.num_free])
        reqs = [p.alloc_request(2048) for p in pools]
        # meta pools: no memory, no addresses; plans name regions and offsets only
        plan = build_plan(pools[0].index_set(reqs[0]), pools[1].index_set(reqs[1]), bufs(pools[0]), bufs(pools[1]))
        cost = TCP_COST  # the Mooncake TCP link's own figures
        assert choose_mode(plan, cost, cfg, cfg.staging_slot_bytes, staging_available=True) is want, (page, layout)
        assert choose_mode(plan, cost, cfg, cfg.staging_slot_bytes, staging_available=False) is Mode.DIRECT
        forced = TransferConfig(mode=Mode.STAGED)
        assert choose_mode(plan, cost, forced, cfg.staging_slot_bytes, staging_available=True) is Mode.STAGED
        assert choose_mode(plan, cost, forced, cfg.staging_slot_bytes, staging_available=False) is Mode.DIRECT
