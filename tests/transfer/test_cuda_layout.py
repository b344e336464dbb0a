"""The host side of a cuda-ipc write (transfer.transports.cuda_layout), on the CPU: the kernel
table and launches laid out for real plans describe exactly the plans' bytes (read back the way
copy_kernel.cu reads them), every range is checked against both sides' regions, and the key
the link's table cache finds a layout by tells runsets apart. The GPU side (the table
uploaded, the kernels run, a layout found again) is scripts/device/checks.sh's."""

import numpy as np
import pytest

from kvpool import HybridPool, Layout, PoolConfig, get_preset
from transfer.buffers import buffers_of
from transfer.errors import OutOfBounds
from transfer.plan import build_plan
from transfer.tokens import Tokens, pool_lanes
from transfer.transports.cuda_layout import PIECE_BYTES, LayoutKey, Regions, absolute, lay_out, layout_key, work
from transfer.transports.ranges import LaneRuns, Ranges, RunSet


def _pool(preset: str, page: int, layout: Layout, seed: int) -> HybridPool:
    pool = HybridPool(PoolConfig(get_preset(preset), page, max_tokens=4096, max_requests=4, layout=layout))
    np.random.default_rng(seed).shuffle(pool.pages._stack[: pool.pages.num_free])  # fragmented pages
    return pool


def _side(name: str, bufs, first: int) -> Regions:
    bases = np.array([(first + i) << 32 for i in range(len(bufs))], dtype=np.int64)
    return Regions(name, bases, np.array([b.nbytes for b in bufs], dtype=np.int64))


def _plan(preset, layout, pages, tokens):
    """A real plan between two fragmented pools of `pages` (source, destination) page sizes,
    and the two sides' regions at made-up addresses."""
    a, b = _pool(preset, pages[0], layout, 1), _pool(preset, pages[1], layout, 2)
    ours, theirs = tuple(buffers_of(a.buffer_descriptors())), tuple(buffers_of(b.buffer_descriptors()))
    lanes = None
    if pages[0] != pages[1]:
        lanes = Tokens(
            tokens,
            *(
                pool_lanes(p.config.model, p.config.page_size, 1, layout, list(bs), "t")
                for p, bs in ((a, ours), (b, theirs))
            ),
        )
    plan = build_plan(a.index_set(a.alloc_request(tokens)), b.index_set(b.alloc_request(tokens)), ours, theirs, lanes)
    return plan, _side("source", ours, 1), _side("destination", theirs, 1000)


def _kernel_rows(layout) -> list[tuple[int, int, int]]:
    """(src, dst, bytes) of every copy the launches make, read from the table as copy_kernel.cu
    reads it."""
    t, out = layout.values.tolist(), []
    for name, rows, ptrs, ints in layout.launches:
        if name == "copy_ranges":
            s, d, m = ptrs
            out += [(t[s + i], t[d + i], t[m + i]) for i in range(rows)]
            continue
        at, n, b = ptrs[0], ints[0], ints[1]
        x = t[at:]
        for q in range(rows):
            bi, i = divmod(q, n)
            if name == "copy_runs":
                it = x[3 * n + 2 * b + bi]
                out.append((x[3 * n + bi] + x[i] * it, x[3 * n + b + bi] + x[n + i] * it, x[2 * n + i] * it))
                continue
            srows, drows, lane = ints[2], ints[3], [x[3 * n + k * b + bi] for k in range(9)]
            s, d, k = x[i], x[n + i], x[2 * n + i]
            src = lane[0] + s // srows * lane[1] + lane[2] + s % srows * lane[3]
            dst = lane[4] + d // drows * lane[5] + lane[6] + d % drows * lane[7]
            if lane[3] == lane[8] and lane[7] == lane[8]:
                out.append((src, dst, k * lane[8]))
            else:
                out += [(src + j * lane[3], dst + j * lane[7], lane[8]) for j in range(k)]
    return out


def _canonical(rows) -> list[tuple[int, int, int]]:
    """The byte mapping as maximal ranges (sorted by source; neighbours on both sides merged)."""
    merged: list[list[int]] = []
    for s, d, m in sorted(r for r in rows if r[2]):
        if merged and merged[-1][0] + merged[-1][2] == s and merged[-1][1] + merged[-1][2] == d:
            merged[-1][2] += m
        else:
            merged.append([s, d, m])
    return [tuple(r) for r in merged]


def _reference(runsets, src: Regions, dst: Regions) -> list[tuple[int, int, int]]:
    flat = Ranges.concat([rs.flatten() for rs in runsets])
    return list(
        zip(
            (src.bases[flat.src_region] + flat.src_off).tolist(),
            (dst.bases[flat.dst_region] + flat.dst_off).tolist(),
            flat.length.tolist(),
        )
    )


@pytest.mark.parametrize(
    "preset, layout, pages, tokens",
    [
        ("tiny-hybrid", Layout.PAGE_MAJOR, (4, 4), 300),
        ("tiny-hybrid", Layout.LAYER_MAJOR, (1, 1), 1500),  # > 4096 ranges: runs x buffers on the GPU
        ("tiny-hybrid", Layout.PAGE_MAJOR, (4, 16), 300),  # by token: lanes
        ("tiny-hybrid", Layout.LAYER_MAJOR, (16, 4), 300),
        ("tiny-mla-nsa", Layout.PAGE_MAJOR, (16, 16), 700),
    ],
)
def test_the_table_holds_exactly_the_plans_bytes(preset, layout, pages, tokens):
    plan, src, dst = _plan(preset, layout, pages, tokens)
    groups = [[c.runset for c in plan.body], [plan.aux.runset]]
    laid = lay_out([work(g, src, dst) for g in groups])
    launches = [name for name, *_ in laid.launches]
    body, aux = _kernel_rows(lay_out([work(groups[0], src, dst)])), _kernel_rows(lay_out([work(groups[1], src, dst)]))
    assert _canonical(body) == _canonical(_reference(groups[0], src, dst))
    assert _canonical(aux) == _canonical(_reference(groups[1], src, dst)) and len(aux) == 1
    assert _kernel_rows(laid) == body + aux and launches[-1] == "copy_ranges"  # the AUX row's launch last
    assert laid.nbytes == plan.nbytes and all(m <= PIECE_BYTES for *_, m in body if len(body) < 4096)


def test_long_ranges_are_cut_into_pieces_and_fielded_sets_go_flat():
    ints = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    src, dst = Regions("source", ints(0, 1 << 40), ints(1 << 30, 1 << 30)), Regions("d", ints(1 << 41), ints(1 << 30))
    same = RunSet(ints(0, 7), ints(3, 1), ints(1, 1), ints(1), ints(0), ints(600_000))  # 3 pieces each
    mixed = RunSet(ints(0, 4), ints(9, 1), ints(3, 1), ints(0), ints(0), ints(100_000))
    fielded = RunSet(
        ints(1, 5), ints(2, 6), ints(2, 1), ints(0, 1), ints(0, 0), ints(4096, 4096), ints(0, 1024), ints(512, 512)
    )
    for rs in (same, mixed, fielded):
        rows = _kernel_rows(lay_out([work([rs], src, dst)]))
        assert _canonical(rows) == _canonical(_reference([rs], src, dst))
        assert max(m for *_, m in rows) <= PIECE_BYTES
    assert len(_kernel_rows(lay_out([work([same], src, dst)]))) == 6


def test_every_range_is_checked_against_both_sides_regions():
    """The link's check (before anything is laid out): a run past the last item any buffer of
    its set holds, a negative start or a region that is not one is refused by side."""
    ints = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    src = Regions("source", ints(0, 1 << 40), ints(4096 * 10, 4096 * 8))
    dst = Regions("destination pid 7", ints(1 << 41, 1 << 42), ints(4096 * 10, 4096 * 10))
    item, regions = ints(4096, 4096), ints(0, 1)
    for region in (regions, ints(0)):
        region.setflags(write=False)
    item.setflags(write=False)
    ok = RunSet(ints(1, 5), ints(2, 6), ints(2, 3), regions, regions, item)  # up to item 8 on both
    assert len(work([ok], src, dst)) == 1
    for bad, side in (
        (RunSet(ints(1, 6), ints(2, 6), ints(2, 3), regions, regions, item), "source"),  # item 9 > 8
        (RunSet(ints(1, 5), ints(2, 8), ints(2, 3), regions, regions, item), "destination pid 7"),
        (RunSet(ints(-1, 5), ints(2, 6), ints(2, 3), regions, regions, item), "source"),
        (RunSet(ints(1), ints(2), ints(1), ints(0, 2), ints(0, 1), item), "source"),
    ):
        with pytest.raises(OutOfBounds, match=f"cuda-ipc: {side} ranges lie outside"):
            work([bad], src, dst)
    loose = ints(0, 1)  # a writeable array is resolved every time: changed, it is checked again
    assert len(work([RunSet(ints(1), ints(1), ints(1), loose, regions, item)], src, dst)) == 1
    loose[1] = 5
    with pytest.raises(OutOfBounds, match="source"):
        work([RunSet(ints(1), ints(1), ints(1), loose, regions, item)], src, dst)
    with pytest.raises(OutOfBounds, match="source"):
        absolute(Ranges.one(1, 4096 * 8, 0, 0, 1), src, dst)


def test_the_key_tells_runsets_apart_and_equal_ones_alike():
    """Issue 41: the table cache was keyed by the table's bytes, so a send laid out and hashed
    the whole table (0.8 MB at 32k tokens of page 1) before it could find it. The key is the
    runsets', equal for equal runsets (fresh arrays), different when a page, a region, a
    lane, the grouping or the flat/absolute kind differs; a long key is compared value by
    value on a hit."""
    plan, _, _ = _plan("tiny-hybrid", Layout.PAGE_MAJOR, (4, 16), 300)
    again, _, _ = _plan("tiny-hybrid", Layout.PAGE_MAJOR, (4, 16), 300)
    groups = lambda p: [[c.runset for c in p.body], [p.aux.runset]]  # noqa: E731
    k = layout_key(groups(plan))
    assert any(isinstance(rs, LaneRuns) for rs in groups(plan)[0])
    assert k.digest == layout_key(groups(again)).digest and k.matches(layout_key(groups(again)))
    ints = lambda *v: np.array(v, dtype=np.int64)  # noqa: E731
    rs = RunSet(ints(1, 5), ints(2, 6), ints(2, 3), ints(0), ints(0), ints(64))
    variants = [
        RunSet(ints(1, 5), ints(2, 7), ints(2, 3), ints(0), ints(0), ints(64)),
        RunSet(ints(1, 5), ints(2, 6), ints(2, 3), ints(1), ints(0), ints(64)),
        RunSet(ints(1, 5), ints(2, 6), ints(2, 3), ints(0), ints(0), ints(128)),
        RunSet(ints(1, 5), ints(2, 6), ints(2, 3), ints(0), ints(0), ints(64), ints(0), ints(32)),
    ]
    keys = {layout_key([[rs]]).digest, layout_key([[rs]], True).digest, layout_key([[rs], []]).digest}
    keys |= {layout_key([[v]]).digest for v in variants} | {layout_key([[rs, rs]]).digest}
    assert len(keys) == 8
    n = 5000  # past the bytes-keyed size
    big = RunSet(np.arange(n), np.arange(n)[::-1].copy(), np.ones(n, dtype=np.int64), ints(0), ints(0), ints(64))
    swapped = RunSet(np.arange(n)[::-1].copy(), np.arange(n), np.ones(n, dtype=np.int64), ints(0), ints(0), ints(64))
    kb, ks = layout_key([[big]]), layout_key([[swapped]])
    assert kb.values is not None and kb.digest != ks.digest and kb.matches(layout_key([[big]]))
    assert not LayoutKey(kb.digest, kb.values).matches(LayoutKey(kb.digest, ks.values))


def test_a_launch_takes_a_block_per_mib_between_the_floor_and_the_cap():
    """The copy is bound by memory latency (its speed is the warps in flight): a big write
    takes more blocks than a small one, never more than the cap (it shares the GPU with the
    model's kernels) nor more than its rows can use."""
    from transfer.transports.cuda_copy import BLOCK_BYTES, MIN_BLOCKS, RangeCopier

    copier = RangeCopier(None, 0, blocks=64)
    many = 1 << 20  # rows enough for any grid
    assert copier.grid(many, 1 << 10) == MIN_BLOCKS  # a small write: the floor
    assert copier.grid(many, 48 * BLOCK_BYTES) == 48  # a block per MiB
    assert copier.grid(many, 48 * BLOCK_BYTES + 1) == 49
    assert copier.grid(many, 150 << 20) == 64  # an 8:1 sender's 151 MB: the cap
    assert copier.grid(1, 150 << 20) == 1  # an AUX row: one warp's work
    assert copier.grid(100, 150 << 20) == 7  # 100 warps of 16 a block
    assert RangeCopier(None, 0, blocks=8).grid(many, 150 << 20) == 8  # a cap below the floor
