"""Test helpers: fill a request's held items with random bytes and read them back."""

import numpy as np
import torch

from kvpool.pools.hybrid import HybridPool
from kvpool.request import RequestKV


def fill_random(pool: HybridPool, req: RequestKV, seed: int) -> dict:
    """Write random bytes into everything `req` holds; return {component: tuple of CPU tensors}."""
    gen = torch.Generator().manual_seed(seed)
    written = {}
    for c, p in pool.pools.items():
        _, items = p.held(req)
        data = tuple(
            torch.randint(0, 256, (len(items), buf.shape[1]), generator=gen, dtype=torch.uint8)
            for buf in p.storage.buffers
        )
        p.storage.scatter(items, data)
        written[c] = data
    return written


def read_held(pool: HybridPool, req: RequestKV) -> dict:
    return {c: p.storage.gather(p.held(req)[1]) for c, p in pool.pools.items()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for c in a:
        assert len(a[c]) == len(b[c])
        for x, y in zip(a[c], b[c]):
            assert torch.equal(x, y), f"{c.value} differs"


def used_counts(pool: HybridPool) -> dict:
    return dict(pool.available())


def all_items_nonzero(arr: np.ndarray) -> bool:
    return bool((arr != 0).all())


def copy_request(src: HybridPool, sreq: RequestKV, dst: HybridPool, dreq: RequestKV) -> None:
    """What a transfer does, byte for byte, within one process: every item the receiver keeps.
    A receiver of `swa_window_only` keeps only the SWA window's pages, which are the last ones
    on both sides, so items pair from the end."""
    s_set, d_set = src.index_set(sreq), dst.index_set(dreq)
    for c in s_set.components():
        n = min(len(s_set[c]), len(d_set[c]))
        dst.pools[c].storage.scatter(
            d_set[c][len(d_set[c]) - n :], src.pools[c].storage.gather(s_set[c][len(s_set[c]) - n :])
        )
