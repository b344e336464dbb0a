"""Prefill's prefix cache with the stand-in engine, in one process: a prompt that starts with
a prompt prefill computed before takes its whole pages from the cache, the engine computes
only the rest and never writes the shared pages, and what the request then holds is, byte for
byte, what a prefill of the whole prompt in a fresh pool holds (every component, every page
size); the cache stays exact under eviction (a pool too small for what it caches keeps
admitting, and every count comes back)."""

import numpy as np
import pytest
import torch

from disagg.engine.standin import StandInEngine
from kvpool import HybridPool, PoolConfig, get_preset
from kvpool.cache.prefix import PrefixCache
from kvpool.errors import AllocatorError
from kvpool.positions import backed, paged_components, state_components, token_items

PRESETS = ["tiny-full", "tiny-swa", "tiny-mla-nsa", "tiny-mamba", "tiny-hybrid"]
ENGINE = StandInEngine()


def pool(preset: str, page: int, max_tokens: int = 1024, device: str = "cpu") -> HybridPool:
    return HybridPool(PoolConfig(get_preset(preset), page, max_tokens=max_tokens, max_requests=8, device=device))


def prefill_cache(p: HybridPool) -> PrefixCache:
    """As the prefill server builds it: every position's SWA page held, hits aligned as the engine says."""
    return PrefixCache(p, window_only=False, align=ENGINE.prefill_reuse(p).align)


def held(p: HybridPool, kv, n: int) -> dict:
    """Every position's bytes of every paged component's parts, the state and the AUX row (CPU)."""
    out = {}
    for c in paged_components(p):
        items, slots = token_items(p, c, kv, np.arange(n))
        assert backed(items).all()  # prefill holds every position of every component
        for pl in p.pools[c].storage.packed.placements:
            seg = pl.segment
            out[c.value, seg.layer, seg.part] = _raw(p.layer_view(seg.layer, seg.part)[items, slots])
    for c in state_components(p):
        item = int(p.index_set(kv)[c][0])
        for pl in p.pools[c].storage.packed.placements:
            out[c.value, pl.segment.layer, pl.segment.part] = _raw(
                p.layer_view(pl.segment.layer, pl.segment.part)[item]
            )
    aux = p.aux.read(kv.aux_row)
    out["aux"] = tuple(np.asarray(aux[k]).tobytes() for k in ("room", "num_tokens", "first_token", "digest"))
    return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    """Its bytes (on the CPU): the stand-in's bytes read as floats hold NaNs, never equal to themselves."""
    return t.contiguous().view(torch.uint8).cpu()


def shared_bytes(p: HybridPool, kv) -> list[torch.Tensor]:
    """The bytes of the request's shared pages (full pages and their SWA pages), every buffer."""
    pages = kv.full_pages[: kv.shared].astype(np.int64)
    out = []
    for c in paged_components(p):
        items = p.swa_allocator.translate(pages).astype(np.int64) if c.value == "swa" else pages
        out += [buf[items].clone() for buf in p.pools[c].storage.buffers]
    return out


def compute(cache: PrefixCache, prompt: np.ndarray, room: int):
    """One prefill request on the cache: -> (kv, hit, result); the caller releases it."""
    kv, hit = cache.admit(prompt)
    result = ENGINE.prefill(cache.pool, kv, prompt, room, cached=hit.prefix_len)
    return kv, hit, result


@pytest.mark.parametrize("page", [1, 4, 16, 64])
@pytest.mark.parametrize("preset", PRESETS)
def test_a_prefill_hit_holds_the_bytes_of_a_whole_prefill(preset, page, device):
    p, fresh = pool(preset, page, device=device), pool(preset, page, device=device)
    cache = prefill_cache(p)
    rng = np.random.default_rng(page)
    first = rng.integers(0, 50000, 150)
    kv, hit, _ = compute(cache, first, 1)
    assert hit.prefix_len == 0
    cache.release(kv, hit, first[: ENGINE.reusable(len(first), len(first))])
    second = np.concatenate([first, rng.integers(0, 50000, 37)])
    kv, hit = cache.admit(second)
    assert hit.prefix_len == 150 // page * page and kv.shared == 150 // page
    before = shared_bytes(p, kv)
    result = ENGINE.prefill(p, kv, second, 2, cached=hit.prefix_len)
    assert all(torch.equal(a, b) for a, b in zip(before, shared_bytes(p, kv))), "a shared page was written"
    whole = fresh.alloc_request(len(second))
    assert ENGINE.prefill(fresh, whole, second, 2) == result
    want, got = held(fresh, whole, len(second)), held(p, kv, len(second))
    assert want.keys() == got.keys()
    differ = [k for k in want if not (np.array_equal(want[k], got[k]) if k == "aux" else torch.equal(want[k], got[k]))]
    assert not differ, differ
    ENGINE.verify(p, kv, second, 2)  # (every position the stand-in recomputes)
    cache.release(kv, hit, None)
    assert cache.drop() == 150 // page
    p.check_integrity()


def test_hits_are_aligned_and_leave_the_last_token():
    p = pool("tiny-swa", 4)
    cache = PrefixCache(p, window_only=False, align=8)
    prompt = np.arange(60)
    kv, hit, _ = compute(cache, prompt, 1)
    cache.release(kv, hit, prompt)
    kv, hit = cache.admit(prompt[:45])  # 44 cached for it (whole pages, the last token left): 40 aligned
    assert hit.prefix_len == 40
    cache.release(kv, hit, None)
    kv, hit = cache.admit(prompt)  # all 60 cached: 56 leave the last token, and 56 is aligned
    assert hit.prefix_len == 56
    cache.release(kv, hit, None)
    with pytest.raises(AllocatorError, match="align"):
        PrefixCache(p, align=0)


@pytest.mark.parametrize("preset", ["tiny-swa", "tiny-hybrid"])
def test_a_pool_full_of_cached_pages_keeps_admitting_and_stays_exact(preset, device):
    """The pool holds 8 prompts' worth; 60 requests of conversations sharing a system prompt
    cache far more than that: admission evicts what nobody uses, every request verifies (the
    shared pages included), and once the cache is dropped every count is back."""
    p = pool(preset, 4, max_tokens=1024, device=device)
    cache = prefill_cache(p)
    start = p.available()
    rng = np.random.default_rng(0)
    system = rng.integers(0, 50000, 64)
    prompts = {c: np.concatenate([system, rng.integers(0, 50000, 20)]) for c in range(12)}
    live = []
    for turn in range(5):
        for c, prompt in prompts.items():
            kv, hit, _ = compute(cache, prompt, 100 * turn + c)
            ENGINE.verify(p, kv, prompt, 100 * turn + c)
            live.append((kv, hit, prompt))
            if len(live) > 2:  # two in flight at a time: their pages must never be evicted
                kv, hit, done = live.pop(0)
                cache.release(kv, hit, done)
            prompts[c] = np.concatenate([prompt, rng.integers(0, 50000, 30)])
    for kv, hit, done in live:
        cache.release(kv, hit, done)
    stats = cache.stats()
    assert stats["evicted_tokens"] > 0 and stats["hit_tokens"] > 0, stats
    assert cache.available()["full_tokens"] == start["full_tokens"]  # unused cached pages count free
    cache.tree.check()
    p.check_integrity()
    cache.drop()
    assert p.available() == start
