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
from transfer.transports.ranges import LaneRuns, Ranges

from kernel_cpu import CpuKernel


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> CpuKernel:
    return CpuKernel(tmp_path_factory.mktemp("copy_kernel"))


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
