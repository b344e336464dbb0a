"""decode.flip corrupts what arrived, never the cached prefix a request shares: a flipped
shared page would fail every later request that reuses it, not just this one."""

import numpy as np
import torch

from disagg.worker.flip import flip_byte
from kvpool import HybridPool, PoolConfig, get_preset
from kvpool.cache.prefix import PrefixCache
from kvpool.components import Component
from kvpool.positions import token_items


def test_the_flip_lands_after_the_prefix():
    pool = HybridPool(PoolConfig(get_preset("tiny-full"), 4, max_tokens=256, max_requests=4, device="cpu"))
    cache = PrefixCache(pool)
    prompt = np.arange(40)
    kv, hit = cache.admit(prompt)
    cache.release(kv, hit, prompt)
    kv, hit = cache.admit(np.concatenate([prompt, np.arange(10)]))
    assert hit.prefix_len == 40
    buf = pool.pools[Component.FULL].storage.buffers[0]
    shared = buf[torch.from_numpy(hit.match.pages.astype(np.int64))].clone()
    flip_byte(pool, kv, hit.prefix_len)
    assert torch.equal(buf[torch.from_numpy(hit.match.pages.astype(np.int64))], shared)
    assert int(buf[int(kv.full_pages[10]), 1]) != 0  # the first page that arrived took it
    cache.release(kv, hit, None)


def test_the_unread_flip_never_lands_in_the_shared_window():
    """decode.flip's first choice, the oldest SWA position decode keeps, falls back to a page
    that arrived when that position is the cache's."""
    from disagg.worker.flip import flip_unread

    pool = HybridPool(PoolConfig(get_preset("tiny-swa"), 4, max_tokens=512, max_requests=4, device="cpu"))
    cache = PrefixCache(pool)
    prompt = np.arange(120)
    kv, hit = cache.admit(prompt)
    cache.release(kv, hit, prompt)
    kv, hit = cache.admit(np.concatenate([prompt, np.arange(6)]))
    assert hit.prefix_len > 0
    before = {c: [b.clone() for b in p.storage.buffers] for c, p in pool.pools.items()}
    what = flip_unread(pool, kv, hit.prefix_len)
    full = pool.pools[Component.FULL].storage.buffers[0]
    pages = torch.from_numpy(hit.match.pages.astype(np.int64))
    assert torch.equal(full[pages], before[Component.FULL][0][pages]), what
    window = pool.config.model.swa.window
    shared = np.arange(max(0, kv.num_tokens - window), hit.prefix_len)  # window positions the cache lent
    assert len(shared), "the case must put the oldest kept position in the shared prefix"
    items, _ = token_items(pool, Component.SWA, kv, shared)
    swa = torch.from_numpy(np.unique(items).astype(np.int64))
    for a, b in zip(before[Component.SWA], pool.pools[Component.SWA].storage.buffers):
        assert torch.equal(a[swa], b[swa]), what
    changed = sum(int((a != b).sum()) for c in before for a, b in zip(before[c], pool.pools[c].storage.buffers))
    assert changed == 1, what
    cache.release(kv, hit, None)
