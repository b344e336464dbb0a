#!/usr/bin/env python3
"""Allocator and index-set figures for 128k-token requests on the largest presets.

Pools are built on torch's `meta` device: allocators and index sets never touch storage, so
the figures are real while a 128k-token llama-3.1-70b pool costs no memory.

    .venv/bin/python scripts/bench_kvpool.py [--json] [--tokens 131072]
"""

import argparse
import json
import time

from kvpool import Component, HybridPool, PoolConfig, get_preset

PRESETS = ["llama-3.1-70b", "deepseek-v3.2", "gemma-3-27b", "gpt-oss-120b", "qwen3-next-80b-a3b"]


def best_of(fn, repeats: int) -> float:
    """Best wall time of `repeats` calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bench(preset: str, page_size: int, tokens: int, repeats: int) -> dict:
    model = get_preset(preset)
    cfg = PoolConfig(model, page_size, max_tokens=tokens * 4, max_requests=64, swa_ratio=1.0, device="meta")
    pool = HybridPool(cfg)

    def alloc_free():
        pool.free_request(pool.alloc_request(tokens))

    req = pool.alloc_request(tokens)
    t_index = best_of(lambda: pool.index_set(req), repeats)
    n_pages = req.num_pages
    pool.free_request(req)
    t_alloc = best_of(alloc_free, repeats)

    small = 2048
    n_small = 48

    def many():
        reqs = [pool.alloc_request(small) for _ in range(n_small)]
        for r in reqs:
            pool.free_request(r)

    t_many = best_of(many, repeats)

    # decode growth, steady state: 256 single-token extends of a long request whose
    # out-of-window SWA pages were already evicted (each step evicts at most one page)
    req = pool.alloc_request(tokens - 512)
    pool.evict_swa(req)
    t0 = time.perf_counter()
    for n in range(req.num_tokens + 1, req.num_tokens + 257):
        pool.extend(req, n)
    t_extend = (time.perf_counter() - t0) / 256
    pool.free_request(req)
    pool.check_integrity()
    return {
        "preset": preset,
        "page_size": page_size,
        "tokens": tokens,
        "pages": n_pages,
        "alloc_free_ms": t_alloc * 1e3,
        "pages_per_s": 2 * n_pages / t_alloc,
        "small_requests_per_s": n_small / t_many,
        "index_set_ms": t_index * 1e3,
        "extend_us": t_extend * 1e6,
        "components": [c.value for c in cfg.components if c is not Component.AUX],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = [bench(p, ps, args.tokens, args.repeats) for p in PRESETS for ps in (1, 16, 64)]
    if args.json:
        print(json.dumps({"rows": rows}, indent=2))
        return
    print(
        f"{'preset':<20} {'page':>4} {'pages':>7} {'alloc+free ms':>13} {'Mpages/s':>9} "
        f"{'2k-req/s':>9} {'index_set ms':>12} {'extend us':>9}  components"
    )
    for r in rows:
        print(
            f"{r['preset']:<20} {r['page_size']:>4} {r['pages']:>7} {r['alloc_free_ms']:>13.3f} "
            f"{r['pages_per_s'] / 1e6:>9.1f} {r['small_requests_per_s']:>9.0f} {r['index_set_ms']:>12.3f} "
            f"{r['extend_us']:>9.1f}  {','.join(r['components'])}"
        )


if __name__ == "__main__":
    main()
