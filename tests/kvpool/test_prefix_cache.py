"""The decode prefix cache on a real pool: a second request takes the first one's pages as
its prefix (SWA window pages included), grows past them without touching them, eviction makes
room whenever the cache is what fills the pool and never takes a page in use, a failed request
leaves nothing of its own, and once the cache is dropped every count is back to its start."""

import numpy as np
import pytest

from kvpool import HybridPool, PoolConfig, get_preset
from kvpool.cache.prefix import PrefixCache, reused_bytes
from kvpool.components import Component
from kvpool.errors import AllocatorError, OutOfSpace
from kvpool.indices import SENTINEL

PRESETS = ["tiny-full", "tiny-swa", "tiny-mla-nsa", "tiny-mamba", "tiny-hybrid"]


def make(preset: str, max_tokens: int = 512, page: int = 4) -> tuple[HybridPool, PrefixCache]:
    pool = HybridPool(PoolConfig(get_preset(preset), page, max_tokens=max_tokens, max_requests=8, device="cpu"))
    return pool, PrefixCache(pool)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1000, n)


def finish(cache: PrefixCache, kv, hit, prompt: np.ndarray, new: int) -> np.ndarray:
    """Grow like a decode of `new` tokens, then end well: returns the ids of what it holds."""
    held = np.concatenate([prompt, tokens(new, 99)])
    for t in range(len(prompt) + 1, len(held) + 1):
        cache.pool.extend(kv, t)
    cache.release(kv, hit, held)
    return held


@pytest.mark.parametrize("extra", [2, 9])  # 2: the new window reaches into the cached pages
@pytest.mark.parametrize("preset", PRESETS)
def test_a_second_turn_takes_the_first_turns_pages(preset, extra):
    pool, cache = make(preset)
    start = pool.available()
    first = tokens(37, 1)
    kv, hit = cache.admit(first, grow_to=37 + 6)
    assert hit.prefix_len == 0
    held = finish(cache, kv, hit, first, 6)  # 43 positions: 10 whole pages cached
    pages = kv.full_pages[:10].copy()
    assert cache.tree.num_pages == 10
    second = np.concatenate([held, tokens(extra, 2)])  # the conversation goes on
    kv2, hit2 = cache.admit(second, grow_to=len(second) + 20)
    assert hit2.prefix_len == 40 and kv2.shared == 10
    assert np.array_equal(kv2.full_pages[:10], pages)
    if Component.SWA in pool.pools:  # the window's pages below the prefix are backed
        swa = pool.swa_allocator
        first_page = max(0, len(second) - pool.config.model.swa.window) // 4
        assert (swa.translate(kv2.full_pages[first_page:10]) != SENTINEL).all()
        assert extra == 9 or first_page < 10
    saved = reused_bytes(pool, len(second), 40)
    assert saved > 0
    for t in range(len(second) + 1, len(second) + 21):  # decode past the shared pages: they stay cached
        pool.extend(kv2, t)
    assert (pool.holders(pages) >= 1).all()
    cache.release(kv2, hit2, None)  # failed: nothing of its own is kept
    assert cache.tree.num_pages == 10
    pool.check_integrity()
    assert cache.drop() == 10
    assert pool.available() == start
    pool.check_integrity()


def test_the_prefix_leaves_prefill_the_last_token():
    pool, cache = make("tiny-full")
    prompt = tokens(32, 3)
    finish(cache, *cache.admit(prompt), prompt, 1)
    kv, hit = cache.admit(prompt)  # the same prompt again: 28 of 32, never 32
    assert hit.prefix_len == 28
    cache.release(kv, hit, None)


def test_a_window_page_without_its_swa_page_cuts_the_hit():
    pool, cache = make("tiny-swa")  # window 8 tokens, pages of 4
    prompt = tokens(40, 4)
    finish(cache, *cache.admit(prompt, grow_to=80), prompt, 40)  # 79 held: SWA only at the end
    longer = np.concatenate([prompt, tokens(3, 5)])  # 43 tokens, window [35, 43): pages 8..10
    kv, hit = cache.admit(longer)  # page 8, 9 lost their SWA pages long ago
    assert hit.prefix_len == 32  # cut back to the window's first page
    cache.release(kv, hit, None)


@pytest.mark.parametrize("preset", ["tiny-full", "tiny-hybrid"])
def test_eviction_keeps_admitting_and_never_takes_a_page_in_use(preset):
    pool, cache = make(preset, max_tokens=256)
    start = pool.available()
    live = []
    base = tokens(40, 6)
    kv, hit = cache.admit(base, grow_to=41)
    finish(cache, kv, hit, base, 1)
    pinned_kv, pinned = cache.admit(np.concatenate([base, tokens(5, 7)]), grow_to=60)  # holds the base's pages
    live.append((pinned_kv, pinned))
    for i in range(60):  # far more than the pool holds, one at a time
        prompt = tokens(30 + i % 17, 100 + i)
        kv, hit = cache.admit(prompt, grow_to=len(prompt) + 3)
        finish(cache, kv, hit, prompt, 3)
        pool.check_integrity()
        cache.tree.check()
    assert cache.evicted_pages > 0
    assert np.array_equal(pinned_kv.full_pages[: pinned.match.num_pages], pinned.match.pages)
    assert (pool.holders(pinned.match.pages) == 2).all()  # the tree's hold and the live request's
    cache.release(pinned_kv, pinned, None)
    cache.drop()
    assert pool.available() == start and cache.tree.num_pages == 0
    pool.check_integrity()


def test_a_pool_full_of_live_requests_still_refuses():
    pool, cache = make("tiny-full", max_tokens=64)
    kv, hit = cache.admit(tokens(60, 8))
    with pytest.raises(OutOfSpace):
        cache.admit(tokens(20, 9))
    cache.release(kv, hit, None)
    assert cache.tree.num_pages == 0


def test_bad_prefixes_are_refused_and_change_nothing():
    pool, cache = make("tiny-swa")
    start = pool.available()
    with pytest.raises(AllocatorError, match="someone holds"):
        pool.alloc_request(20, swa_window_only=True, prefix=np.array([3, 4], dtype=np.int32))
    kv = pool.alloc_request(20, swa_window_only=True)
    with pytest.raises(AllocatorError, match="no page of its own"):
        pool.alloc_request(8, swa_window_only=True, prefix=kv.full_pages[:2])
    with pytest.raises(AllocatorError, match="no SWA page"):  # page 0 left kv's window
        pool.alloc_request(12, swa_window_only=True, prefix=kv.full_pages[:2])
    pool.free_request(kv)
    assert pool.available() == start
    pool.check_integrity()
