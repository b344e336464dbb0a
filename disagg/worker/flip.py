"""Corruption on purpose, for the tests to show that every check that guards an answer fails
the request instead of passing a wrong answer off as a good one:

    decode.flip   one byte of what arrived, before decode verifies it: a byte no decode step
                  reads where the pool holds one (flip_unread), else one every step reads;
                  only comparing the bytes with prefill's digest can catch the first
    prefill.flip  one byte of what prefill computed, before it is digested and sent (a
                  wrong computation: only the colocated check can catch it)
"""

import numpy as np
import torch

from kvpool import Component, HybridPool, RequestKV
from kvpool.positions import token_items

FLIP = 0x40  # an exponent bit of the byte's value: the model cannot round it away


def flip_byte(pool: HybridPool, kv: RequestKV, prefix_len: int = 0) -> str:
    """Flip one byte of `kv` that arrived and the next decode step reads: the last byte of its
    state slot's last buffer (the newest conv column or the recurrent state: both read by every
    step), else the high byte of the first value of the first position at or after
    `prefix_len` in its full (or NSA) pages (a cached prefix before it is decode's prefix
    cache's, shared: it did not arrive). Returns what it flipped, for the log."""
    for c in (Component.MAMBA, Component.FULL, Component.NSA):
        part = pool.pools.get(c)
        if part is None:
            continue
        _, items = part.held(kv)
        if c is Component.MAMBA:
            buf, item, offset = part.storage.buffers[-1], int(items[0]), -1
        else:
            buf, item, offset = part.storage.buffers[0], int(items[prefix_len // pool.page_size]), 1
        buf[item, offset] ^= FLIP
        return f"{c.value} item {item}, byte {offset % buf.shape[1]} of buffer row"
    raise ValueError("the pool holds no component decode.flip can corrupt")


def flip_unread(pool: HybridPool, kv: RequestKV, prefix_len: int = 0) -> str:
    """Flip a byte that no decode step reads, where there is one: the oldest position a
    sliding window keeps (a receiver keeps `window` positions, the model attends to the
    last `window - 1` and the token it computes), the high byte of its first K value in the
    first SWA layer, unless it lies in the prefix decode's cache lent the request (positions
    below `prefix_len`: shared, it did not arrive). Else flip_byte. Returns what it flipped,
    for the log."""
    spec = pool.config.model.swa
    oldest = kv.num_tokens - spec.window if spec is not None else -1
    if oldest < prefix_len:  # (none kept, or the cache's)
        return flip_byte(pool, kv, prefix_len)
    items, slots = token_items(pool, Component.SWA, kv, np.array([oldest]))
    layer = spec.layers[0]
    first = pool.layer_view(layer, "k")[int(items[0]), int(slots[0])].reshape(-1)[:1]  # a view of the pool
    first.view(torch.uint8)[-1] ^= FLIP  # its high byte (little-endian)
    return f"swa layer {layer} k, position {oldest} (no decode step reads it)"
