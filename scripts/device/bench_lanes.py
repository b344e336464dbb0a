#!/usr/bin/env python3
"""The copy kernels alone on one GPU, device-local: one sender's table for a real plan (a TP
rank's head slices into another TP size's pool, or 1:1 pages), laid out as the cuda-ipc link
lays it out, launched as RangeCopier launches it (--blocks x 512 threads, each count of the list), timed with CUDA events;
per kernel source, so a changed copy_lanes is measured beside the one it replaces on the same
tables, and its bytes compared with that one's (every destination byte equal).

    python3 scripts/device/bench_lanes.py [--tokens 32768] [--page 16] [--pairs 1:1,8:1,2:1,1:8]
        [--kernel NAME=PATH[:DEFINE=V]]...   (default: this tree's copy_kernel.cu) [--blocks 32,64,132]

Each row: the pair, the sender's bytes, the kernels' launches, then per kernel source the
median ms of --repeats launches and GB/s, and a device-local copy of the same byte count.
"""

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kvpool import HybridPool, Layout, PoolConfig, get_preset  # noqa: E402
from transfer.buffers import buffers_of  # noqa: E402
from transfer.plan import build_plan  # noqa: E402
from transfer.reshard import Shard, pair_lanes  # noqa: E402
from transfer.tokens import Tokens, pool_lanes  # noqa: E402
from transfer.transports.cuda_layout import Regions, lay_out, work  # noqa: E402


def side(preset: str, page: int, tp: int, tokens: int):
    pool = HybridPool(
        PoolConfig(get_preset(preset), page, max_tokens=int(tokens * 2.5), max_requests=1, tp_size=tp, device="cuda")
    )
    for p in pool.pools.values():  # (pages in order, as bench_tp.py's pools)
        for b in p.storage.buffers:
            b.random_(0, 256)
    descs = pool.buffer_descriptors()
    bufs = tuple(buffers_of(descs))
    regions = Regions("side", np.array([d.ptr for d in descs], dtype=np.int64), np.array([d.nbytes for d in descs]))
    lanes = pool_lanes(pool.config.model, page, tp, Layout.PAGE_MAJOR, list(bufs), "side")
    return pool, bufs, regions, lanes, pool.index_set(pool.alloc_request(tokens))


def layout_for(preset: str, n: int, m: int, page: int, tokens: int):
    """The table of prefill rank 0 of n into decode rank 0 of m, and both pools (the source
    kept alive with the table: freed, its memory went to the clones, and reads saw them)."""
    a, b = side(preset, page, n, tokens), side(preset, page, m, tokens)
    tok = None
    if n != m:
        mine, theirs = pair_lanes(get_preset(preset), Shard(page, n, 0), Shard(page, m, 0), a[3], b[3])
        tok = Tokens(tokens, mine, theirs, True)
    plan = build_plan(a[4], b[4], a[1], b[1], tok)
    groups = [[c.runset for c in plan.body]] + ([[plan.aux.runset]] if plan.aux is not None else [])
    return lay_out([work(g, a[2], b[2]) for g in groups]), b[0], a[0]


def compile_kernels(spec: str):
    import cupy

    name, _, rest = spec.partition("=")
    path, *defines = rest.split(":") if rest else [str(ROOT / "transfer/transports/copy_kernel.cu")]
    module = cupy.RawModule(code=Path(path).read_text(), options=tuple(f"-D{d}" for d in defines))
    try:  # (registers, and local memory: > 0 means it spilled)
        a = module.get_function("copy_lanes").attributes
        print(f"{name or 'tree'}: copy_lanes {a['num_regs']} registers, {a['local_size_bytes']} B local", flush=True)
    except Exception as exc:  # noqa: BLE001 (a CuPy without the attributes: the timings still stand)
        print(f"{name or 'tree'}: no attributes ({exc})", flush=True)
    return name or "tree", module


def launcher(module, layout, table: torch.Tensor, blocks: int = 32):
    fns = [
        (module.get_function(name), min(blocks, -(-rows * 32 // 512)), [table.data_ptr() + 8 * p for p in ptrs], ints)
        for name, rows, ptrs, ints in layout.launches
        if rows
    ]

    def go() -> None:
        for fn, grid, ptrs, ints in fns:
            fn((grid,), (512,), tuple(np.int64(v) for v in (*ptrs, *ints)))

    return go


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def row(args, n: int, m: int, modules) -> str:
    layout, dst, _src = layout_for(args.preset, n, m, args.page, args.tokens)
    table = torch.from_numpy(layout.values).cuda()
    bufs = [b for p in dst.pools.values() for b in p.storage.buffers]
    start = [b.clone() for b in bufs]
    cells, first = [], None
    for (name, module), blocks in ((m, b) for m in modules for b in args.blocks):
        for b, s in zip(bufs, start):
            b.copy_(s)
        go = launcher(module, layout, table, blocks)
        go()
        torch.cuda.synchronize()
        got = [b.clone() for b in bufs]
        same = first is None or all(torch.equal(x, y) for x, y in zip(got, first))
        first = first or got
        ms = timed(go, args.repeats)
        cells.append(
            f"{name} x{blocks} {ms:.3f} ms {layout.nbytes / ms / 1e6:6.0f} GB/s{'' if same else ' BYTES DIFFER'}"
        )
    x = torch.empty(layout.nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    copy_ms = timed(lambda: y.copy_(x), args.repeats)
    kernels = "+".join(f"{name}x{rows}" for name, rows, *_ in layout.launches)
    return (
        f"{n}:{m} {layout.nbytes / 1e6:7.1f} MB [{kernels}] | "
        + " | ".join(cells)
        + f" | device copy {copy_ms:.3f} ms {layout.nbytes / copy_ms / 1e6:.0f} GB/s"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-120b")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--pairs", default="1:1,8:1,2:1,1:8")
    ap.add_argument("--kernel", action="append", default=[], help="NAME=PATH[:DEFINE=V...]; repeatable")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--blocks", default="32", help="thread blocks (of 512 threads) per launch: a list, each timed")
    args = ap.parse_args()
    args.blocks = [int(b) for b in args.blocks.split(",")]
    modules = [compile_kernels(k) for k in args.kernel or [""]]
    print(torch.cuda.get_device_name(), flush=True)
    for pair in args.pairs.split(","):
        n, m = (int(v) for v in pair.split(":"))
        print(row(args, n, m, modules), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
