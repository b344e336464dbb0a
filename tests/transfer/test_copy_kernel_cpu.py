"""copy_kernel.cu itself, run on the CPU (tests/transfer/kernel_cpu.py), on tables laid out for
real plans between pools in this process's memory: after the launches, every destination
byte is what the plan's flat ranges say (the bytes it names copied from the source, all
others untouched). TP shards move a slice of every row (a head lane: 128 B rows a 1 KiB
stride apart for gpt-oss), the shape issue 40's resharded rows send; the GPU runs the same
source (scripts/device/checks.sh)."""

import ctypes

import numpy as np
import pytest

from kvpool import HybridPool, Layout, PoolConfig, get_preset
from transfer.buffers import buffers_of
from transfer.plan import build_plan
from transfer.reshard import Shard, pair_lanes
from transfer.tokens import Tokens, pool_lanes
from transfer.transports.cuda_layout import Regions, lay_out, work
from transfer.transports.ranges import LANE_FIELDS, LaneRuns, Ranges

from kernel_cpu import VARIANTS, CpuKernel


@pytest.fixture(scope="module", params=list(VARIANTS))
def kernel(request, tmp_path_factory) -> CpuKernel:
    return CpuKernel(tmp_path_factory.mktemp("copy_kernel"), VARIANTS[request.param])


def _bytes(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_uint8)), shape=(nbytes,))


class _Side:
    """A pool of one TP shard in host memory, its pages shuffled and every byte random."""

    def __init__(self, preset: str, page: int, layout: Layout, tp: tuple[int, int], seed: int):
        self.pool = HybridPool(
            PoolConfig(
                get_preset(preset),
                page,
                max_tokens=640,
                max_requests=2,
                layout=layout,
                tp_size=tp[0],
                tp_rank=tp[1],
                device="cpu",  # (the kernel runs on the CPU: "auto" put them on a GPU there)
            )
        )
        rng = np.random.default_rng(seed)
        for alloc in (self.pool.pages, getattr(self.pool.swa_allocator, "swa", None)):
            if alloc is not None:  # fragmented pages
                rng.shuffle(alloc._stack[: alloc.num_free])
        for p in self.pool.pools.values():
            for b in p.storage.buffers:
                b.random_(0, 256)
        descs = self.pool.buffer_descriptors()
        self.bufs = tuple(buffers_of(descs))
        self.views = [_bytes(d.ptr, d.nbytes) for d in descs]
        self.regions = Regions(
            "side", np.array([d.ptr for d in descs], dtype=np.int64), np.array([d.nbytes for d in descs])
        )
        cfg = self.pool.config
        self.lanes = pool_lanes(cfg.model, page, tp[0], layout, list(self.bufs), "side")
        self.shard = Shard(page, tp[0], tp[1])


def _expected(runsets, src: _Side, dst: _Side) -> list[np.ndarray]:
    """The destination's regions after the plan's flat ranges, copied one by one in numpy."""
    out = [v.copy() for v in dst.views]
    flat = Ranges.concat([rs.flatten() for rs in runsets])
    for sr, so, dr, do, n in zip(
        *(a.tolist() for a in (flat.src_region, flat.src_off, flat.dst_region, flat.dst_off, flat.length))
    ):
        out[dr][do : do + n] = src.views[sr][so : so + n]
    return out


@pytest.mark.parametrize(
    "preset, layout, pages, tp",
    [
        ("gpt-oss-20b", Layout.PAGE_MAJOR, (16, 16), ((8, 3), (1, 0))),  # 8:1 - a head into rows of 8
        ("gpt-oss-20b", Layout.PAGE_MAJOR, (16, 16), ((1, 0), (8, 5))),  # 1:8 - a head out of rows of 8
        ("gpt-oss-20b", Layout.PAGE_MAJOR, (16, 16), ((2, 1), (1, 0))),  # 2:1 - 512 B of 1 KiB rows
        ("gpt-oss-20b", Layout.PAGE_MAJOR, (16, 16), ((8, 6), (2, 1))),  # 8:2
        ("gpt-oss-20b", Layout.LAYER_MAJOR, (16, 4), ((4, 1), (1, 0))),  # other page sizes too
        ("gpt-oss-20b", Layout.PAGE_MAJOR, (4, 16), ((1, 0), (1, 0))),  # whole rows: pages differ only
        ("tiny-mla-nsa", Layout.PAGE_MAJOR, (4, 4), ((1, 0), (2, 1))),  # rows not 16-byte multiples
        ("tiny-swa", Layout.PAGE_MAJOR, (4, 4), ((1, 0), (2, 1))),
        ("tiny-hybrid", Layout.PAGE_MAJOR, (4, 4), ((2, 0), (1, 0))),
    ],
)
def test_the_kernel_writes_exactly_the_plans_bytes(kernel, preset, layout, pages, tp):
    src, dst = _Side(preset, pages[0], layout, tp[0], 1), _Side(preset, pages[1], layout, tp[1], 2)
    tokens = 300
    mine, theirs = pair_lanes(src.pool.config.model, src.shard, dst.shard, src.lanes, dst.lanes)
    plan = build_plan(
        src.pool.index_set(src.pool.alloc_request(tokens)),
        dst.pool.index_set(dst.pool.alloc_request(tokens)),
        src.bufs,
        dst.bufs,
        Tokens(tokens, mine, theirs, tp[0][0] != tp[1][0]),
    )
    groups = [[c.runset for c in plan.body]] + ([[plan.aux.runset]] if plan.aux is not None else [])
    runsets = [rs for g in groups for rs in g]
    if preset.startswith("gpt-oss") and tp[0][0] != tp[1][0]:
        assert any(isinstance(rs, LaneRuns) and not rs.whole.all() for rs in runsets)  # sliced lanes
    expected = _expected(runsets, src, dst)
    source = [v.copy() for v in src.views]
    laid = lay_out([work(g, src.regions, dst.regions) for g in groups])
    assert laid.nbytes == plan.nbytes > 0
    before = [v.copy() for v in dst.views]
    for blocks in (32, 3):  # as launched; and few warps, each taking many batches of items
        for v, b in zip(dst.views, before):
            v[:] = b
        kernel.run(laid, blocks=blocks)
        for got, want in zip(dst.views, expected):
            assert np.array_equal(got, want)
        assert all(np.array_equal(a, b) for a, b in zip(src.views, source))


# Lanes of every path copy_lanes has, between pages of 16 rows (source) and 12 rows
# (destination: a quotient by division, not a shift): (row bytes, source stride and offset,
# destination stride and offset)
_LANES = (
    (128, 128, 0, 1024, 384),  # a head of 8: small items (up to 12 rows x 8 words)
    (512, 512, 0, 1024, 512),  # 2:1's half rows: past the small path (chunks / copy_rows)
    (40, 40, 0, 48, 8),  # rows not 16-byte multiples: byte by byte
    (48, 64, 16, 48, 0),  # three words a row: y / 3, not a shift
    (1024, 1024, 0, 1024, 0),  # whole rows on both sides (chunks / copy_one)
)


def _edge_runs(n: int, seed: int) -> LaneRuns:
    """n runs of 1-12 rows from random source pages into destination rows one after another
    (no two runs write the same byte), none crossing a page on either side."""
    rng = np.random.default_rng(seed)
    src, dst, count, at = [], [], [], 0
    for _ in range(n):
        c = int(rng.integers(1, 13))
        if at % 12 + c > 12:
            at += 12 - at % 12
        o = int(rng.integers(0, 17 - c))
        src.append(int(rng.integers(0, 4)) * 16 + o)
        dst.append(at)
        count.append(c)
        at += c
    lanes = np.array(_LANES, dtype=np.int64).T
    row, s_stride, s_off, d_stride, d_off = lanes
    b = len(_LANES)
    return LaneRuns(
        *(np.array(v, dtype=np.int64) for v in (src, dst, count)),
        src_offset=s_off, dst_offset=d_off, row_bytes=row,
        src_region=np.arange(b, dtype=np.int64), dst_region=np.arange(b, dtype=np.int64),
        src_pitch=16 * s_stride, dst_pitch=12 * d_stride, src_stride=s_stride, dst_stride=d_stride,
        src_rows=16, dst_rows=12,
    )  # fmt: skip


def _regions(name: str, views: list[np.ndarray]) -> Regions:
    return Regions(name, np.array([v.ctypes.data for v in views], dtype=np.int64), np.array([v.size for v in views]))


def _want(runs: LaneRuns, gone: int, src: list[np.ndarray], dst: list[np.ndarray]) -> list[np.ndarray]:
    """The destination after every run but `gone`, copied range by range in numpy."""
    keep = np.arange(len(runs.count)) != gone
    lanes = {f: getattr(runs, f) for f in LANE_FIELDS}
    starts = (runs.src_start[keep], runs.dst_start[keep], runs.count[keep])
    flat = LaneRuns(*starts, **lanes, src_rows=runs.src_rows, dst_rows=runs.dst_rows).flatten()
    out = [v.copy() for v in dst]
    for sr, so, dr, do, m in zip(
        *(a.tolist() for a in (flat.src_region, flat.src_off, flat.dst_region, flat.dst_off, flat.length))
    ):
        out[dr][do : do + m] = src[sr][so : so + m]
    return out


@pytest.mark.parametrize("warps, threads", [(1, 32), (2, 32), (3, 32), (7, 32), (16, 512)])
def test_copy_lanes_edges(kernel, warps, threads):
    """Batches that cross the table's end (37 runs x 5 lanes over 1-16 warps: the last batch,
    and the one loaded ahead of it, partly past the end), a run of no rows (its count zeroed
    in the table: the kernel copies nothing for it), items of every path (small, past small,
    unaligned bytes, rows of three words, whole rows): every destination byte as the runs say."""
    runs, gone = _edge_runs(37, 3), 17
    rng = np.random.default_rng(4)
    pages = (4, int(runs.dst_start[-1]) // 12 + 1)
    src = [rng.integers(0, 256, size=int(p), dtype=np.uint8) for p in runs.src_pitch * pages[0]]
    dst = [rng.integers(0, 256, size=int(p), dtype=np.uint8) for p in runs.dst_pitch * pages[1]]
    want = _want(runs, gone, src, dst)
    laid = lay_out([work([runs], _regions("src", src), _regions("dst", dst))])
    ((name, rows, (at,), (n, *_)),) = laid.launches
    assert name == "copy_lanes" and rows == 37 * len(_LANES)
    laid.values[at + 2 * n + gone] = 0
    kernel.run(laid, blocks=warps, threads=threads)
    for got, w in zip(dst, want):
        assert np.array_equal(got, w)
