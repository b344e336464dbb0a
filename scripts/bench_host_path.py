#!/usr/bin/env python3
"""Host time of one send planned on the spot over cuda-ipc, on the CPU (no GPU, no memory:
pools on the meta device, their free pages shuffled as scripts/bench_transfer.py does):

    plan    build_plan with the sender's buffer tuples (KVSender.plan), and its runsets
    layout  the link's host side of prepare_chain: the runsets' key, their checks against both
            sides' regions and the kernel table laid out (transfer/transports/cuda_layout.py),
            as for pages the link has not laid out before
    hit     the key and the cache's lookup, as for pages laid out before (the same request
            sent again: every repeat of bench_transfer's planned-on-the-spot rows)

TP rows (issue 40, "N:M"): prefill rank 0 of N into decode rank 0 of M, head slices (LaneRuns);
1:8 is one prefill process sending to eight decode ranks: its row is the eight sends' total.

What it leaves out is the GPU's: the table's upload on a miss, the launches, the event.
Times are the fastest of --repeats (a shared machine's noise only adds).

    # gpt-oss-120b and Qwen3-Next, 2k and 32k tokens, the rows issue 41 names (about a minute)
    .venv/bin/python scripts/bench_host_path.py
"""

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpool import HybridPool, Layout, PoolConfig, get_preset  # noqa: E402
from transfer.buffers import buffers_of  # noqa: E402
from transfer.plan import build_plan  # noqa: E402
from transfer.reshard import pair_lanes  # noqa: E402
from transfer.tokens import Tokens, pool_lanes  # noqa: E402
from transfer.transports.cuda_layout import Regions, lay_out, layout_key, work  # noqa: E402

ROWS = [
    ("gpt-oss-120b", "page_major", 1, 2048),
    ("gpt-oss-120b", "page_major", 16, 2048),
    ("gpt-oss-120b", "layer_major", 1, 2048),
    ("gpt-oss-120b", "page_major", 1, 32768),
    ("gpt-oss-120b", "page_major", 16, 32768),
    ("gpt-oss-120b", "layer_major", 1, 32768),
    ("qwen3-next-80b-a3b", "layer_major", 1, 32768),
    ("qwen3-next-80b-a3b", "page_major", 64, 32768),
    ("gpt-oss-120b", "page_major", 16, 32768, "8:1"),
    ("gpt-oss-120b", "page_major", 16, 32768, "1:8"),
]


def fastest(fn, repeats: int) -> float:
    """ms of the fastest of `repeats` calls, after one."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def sides(preset: str, layout: Layout, page: int, tokens: int, tp: tuple[tuple[int, int], ...] = ((1, 0), (1, 0))):
    """Two fragmented meta pools' index sets, buffer tuples, regions (made-up addresses) and
    pools, of TP (size, rank) `tp` each."""
    out = []
    for seed, (size, rank) in zip((1, 2), tp):
        pool = HybridPool(
            PoolConfig(
                get_preset(preset),
                page,
                max_tokens=int(tokens * 2.5),
                max_requests=4,
                layout=layout,
                tp_size=size,
                tp_rank=rank,
                device="meta",
            )
        )
        rng = np.random.default_rng(seed)
        for alloc in (pool.pages, getattr(pool.swa_allocator, "swa", None)):
            if alloc is not None:
                rng.shuffle(alloc._stack[: alloc.num_free])
        bufs = tuple(buffers_of(pool.buffer_descriptors()))
        bases = (np.arange(len(bufs), dtype=np.int64) + 64 * seed) << 36
        out.append(
            (
                pool.index_set(pool.alloc_request(tokens)),
                bufs,
                Regions("side", bases, np.array([b.nbytes for b in bufs])),
                pool,
            )
        )
    return out


def tp_sends(preset: str, layout: Layout, page: int, tokens: int, tp: str) -> list[tuple]:
    """(src, dst, ours, theirs, tokens, at_src, at_dst) of each send of prefill rank 0 of N to
    the decode ranks of M it writes (N:1: rank 0; 1:M: every rank)."""
    n, m = (int(v) for v in tp.split(":"))
    out = []
    for rank in range(m if n == 1 else 1):
        (src, ours, at_src, a), (dst, theirs, at_dst, b) = sides(preset, layout, page, tokens, ((n, 0), (m, rank)))
        lanes = [
            pool_lanes(p.config.model, page, p.config.tp_size, layout, list(bs), "t")
            for p, bs in ((a, ours), (b, theirs))
        ]
        mine, their_lanes = pair_lanes(a.config.model, a.config.shard, b.config.shard, *lanes)
        out.append((src, dst, ours, theirs, Tokens(tokens, mine, their_lanes, True), at_src, at_dst))
    return out


def runsets(plan) -> list:
    return [[c.runset for c in plan.body]] + ([[plan.aux.runset]] if plan.aux is not None else [])


def row(preset: str, layout: Layout, page: int, tokens: int, repeats: int, tp: str = "1:1") -> dict:
    if tp != "1:1":
        return tp_row(preset, layout, page, tokens, repeats, tp)
    (src, ours, at_src, _), (dst, theirs, at_dst, _) = sides(preset, layout, page, tokens)
    groups = runsets(build_plan(src, dst, ours, theirs))
    key = layout_key(groups)
    cache = {key.digest: (key, lay_out([work(g, at_src, at_dst) for g in groups]))}

    def hit() -> None:
        k = layout_key(groups)
        assert cache[k.digest][0].matches(k)

    return {
        "preset": preset,
        "layout": layout.value,
        "page_size": page,
        "tokens": tokens,
        "tp": tp,
        "plan_ms": round(fastest(lambda: runsets(build_plan(src, dst, ours, theirs)), repeats), 3),
        "layout_ms": round(
            fastest(lambda: (layout_key(groups), lay_out([work(g, at_src, at_dst) for g in groups])), repeats), 3
        ),
        "hit_ms": round(fastest(hit, repeats), 3),
    }


def tp_row(preset: str, layout: Layout, page: int, tokens: int, repeats: int, tp: str) -> dict:
    """A TP row: every send of the prefill rank (plan, layout, hit), summed over its sends."""
    sends = tp_sends(preset, layout, page, tokens, tp)
    groups = [runsets(build_plan(s, d, o, t, k)) for s, d, o, t, k, *_ in sends]
    keys = [layout_key(g) for g in groups]

    def plan_all() -> None:
        for s, d, o, t, k, *_ in sends:
            runsets(build_plan(s, d, o, t, k))

    def lay_all() -> None:
        for g, (*_, at_src, at_dst) in zip(groups, sends):
            layout_key(g), lay_out([work(x, at_src, at_dst) for x in g])

    def hit_all() -> None:
        for g, k in zip(groups, keys):
            assert layout_key(g).matches(k)

    return {
        "preset": preset,
        "layout": layout.value,
        "page_size": page,
        "tokens": tokens,
        "tp": tp,
        "plan_ms": round(fastest(plan_all, repeats), 3),
        "layout_ms": round(fastest(lay_all, repeats), 3),
        "hit_ms": round(fastest(hit_all, repeats), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--tp-only", action="store_true", help="only the TP rows (issue 40)")
    args = ap.parse_args()
    print(
        f"{'preset':<20} {'layout':<12} {'page':>4} {'tokens':>6} {'tp':>4} {'plan':>7} {'layout':>7} {'hit':>7}  (ms, fastest)"
    )
    for preset, layout, page, tokens, *tp in ROWS:
        if args.tp_only and not tp:
            continue
        r = row(preset, Layout(layout), page, tokens, args.repeats, *tp)
        print(
            f"{preset:<20} {layout:<12} {page:>4} {tokens:>6} {r['tp']:>4} "
            f"{r['plan_ms']:>7.3f} {r['layout_ms']:>7.3f} {r['hit_ms']:>7.3f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
