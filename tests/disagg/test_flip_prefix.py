"""decode.flip corrupts what arrived, never the cached prefix a request shares: a flipped
shared page would fail every later request that reuses it, not just this one."""

import numpy as np
import torch

from disagg.decode.flip import flip_byte
from kvpool import HybridPool, PoolConfig, get_preset
from kvpool.cache.prefix import PrefixCache
from kvpool.components import Component


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
    assert int(buf[int(kv.full_pages[10]), 1]) != 0          # the first page that arrived took it
    cache.release(kv, hit, None)
