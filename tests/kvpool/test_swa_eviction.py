import numpy as np
import pytest

from kvpool import Component, HybridPool, OutOfSpace, PoolConfig, get_preset
from kvpool.pools.swa import window_first_page


@pytest.mark.parametrize(
    "tokens,window,page,first",
    [
        (1, 8, 4, 0),
        (8, 8, 4, 0),
        (9, 8, 4, 0),
        (12, 8, 4, 1),
        (13, 8, 4, 1),
        (16, 8, 4, 2),
        (130, 128, 16, 0),
        (144, 128, 16, 1),
        (2048, 128, 16, 120),
        (5, 3, 1, 2),
    ],
)
def test_window_first_page(tokens, window, page, first):
    assert window_first_page(tokens, window, page) == first
    # the first window page holds a token inside the window, the page before it holds none
    start = max(0, tokens - window)
    assert first * page <= start < (first + 1) * page or start == 0


def test_eviction_frees_exactly_the_out_of_window_pages(device):
    pool = HybridPool(PoolConfig(get_preset("tiny-swa"), 4, max_tokens=256, max_requests=4, device=device))
    swa = pool.swa_allocator
    req = pool.alloc_request(10)  # pages 0..2, all backed (prefill)
    assert (swa.translate(req.full_pages) != 0).all()
    # grow token by token; at each length exactly the pages before the window are unbacked
    for n in range(11, 60):
        pool.extend(req, n)
        backed = swa.translate(req.full_pages) != 0
        first = window_first_page(n, 8, 4)
        assert not backed[:first].any() and backed[first:].all(), n
        assert swa.swa.used().size == backed.sum()
    assert len(pool.index_set(req)[Component.SWA]) == len(req.full_pages) - window_first_page(59, 8, 4)
    pool.free_request(req)
    pool.check_integrity()
    assert swa.swa.num_free == pool.sizes.swa_pages


def test_evict_swa_after_prefill_returns_count():
    pool = HybridPool(PoolConfig(get_preset("tiny-swa"), 4, max_tokens=256, max_requests=4))
    req = pool.alloc_request(30)  # 8 pages; window 8 -> tokens 22..29 -> pages 5..7
    assert pool.evict_swa(req) == 5
    assert pool.evict_swa(req) == 0  # idempotent
    assert (pool.swa_allocator.translate(req.full_pages[:5]) == 0).all()
    assert len(pool.index_set(req)[Component.SWA]) == 3


def test_window_only_allocation_backs_just_the_window():
    pool = HybridPool(PoolConfig(get_preset("tiny-swa"), 4, max_tokens=256, max_requests=4))
    req = pool.alloc_request(30, swa_window_only=True)
    backed = pool.swa_allocator.translate(req.full_pages) != 0
    assert backed.tolist() == [False] * 5 + [True] * 3


def test_extend_reuses_evicted_swa_pages_when_the_swa_pool_is_tight():
    # swa pool: 32 * 0.125 = 4 pages; one request growing forever must never run out
    pool = HybridPool(PoolConfig(get_preset("tiny-swa"), 4, max_tokens=512, max_requests=2, swa_ratio=0.125))
    assert pool.sizes.swa_pages == 16
    req = pool.alloc_request(8, swa_window_only=True)
    for n in range(9, 500, 7):
        pool.extend(req, n)
    assert pool.swa_allocator.swa.used().size <= 3
    pool.check_integrity()


def test_extend_without_space_changes_nothing():
    pool = HybridPool(PoolConfig(get_preset("tiny-swa"), 4, max_tokens=64, max_requests=2))
    req = pool.alloc_request(60, swa_window_only=True)
    pages_before, mapping_before = req.full_pages.copy(), pool.swa_allocator.mapping.copy()
    with pytest.raises(OutOfSpace):
        pool.extend(req, 80)
    assert req.num_tokens == 60 and np.array_equal(req.full_pages, pages_before)
    assert np.array_equal(pool.swa_allocator.mapping, mapping_before)
    pool.check_integrity()


def test_index_arrays_handed_out_stay_valid_while_a_request_grows():
    pool = HybridPool(PoolConfig(get_preset("tiny-full"), 4, max_tokens=1024, max_requests=2))
    req = pool.alloc_request(5)
    early = req.full_pages
    snapshot = early.copy()
    for n in range(6, 400, 3):
        pool.extend(req, n)
    assert np.array_equal(early, snapshot)
    assert np.array_equal(req.full_pages[: len(snapshot)], snapshot)
    assert len(np.unique(req.full_pages)) == req.num_pages == 100
    assert not req.full_pages.flags.writeable
    pool.check_integrity()


def test_swa_frontier_matches_the_mapping():
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=512, max_requests=2))
    req = pool.alloc_request(50)
    for n in (51, 60, 61, 90, 200):
        pool.extend(req, n)
        backed = pool.swa_allocator.translate(req.full_pages) != 0
        assert not backed[: req.swa_evicted].any() and backed[req.swa_evicted :].all()
