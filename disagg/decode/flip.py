"""A corruption on purpose (fault point `decode.flip`): one byte of what arrived for a request
is flipped before decode verifies it, so the tests can show that every check that guards an
answer (the stand-in's byte-for-byte verify, the colocated check of the model engine) fails
the request instead of passing a wrong answer off as a good one."""

from kvpool import Component, HybridPool, RequestKV

FLIP = 0x40   # an exponent bit of the byte's value: the model cannot round it away


def flip_byte(pool: HybridPool, kv: RequestKV, prefix_len: int = 0) -> str:
    """Flip one byte of `kv` that arrived and the next decode step reads: the last byte of its
    state slot's last buffer (the newest conv column or the recurrent state: both read by every
    step), else the high byte of the first value of the first position at or after
    `prefix_len` in its full (or NSA) pages (a cached prefix before it is the cache's, shared:
    it did not arrive). Returns what it flipped, for the log."""
    for c in (Component.MAMBA, Component.FULL, Component.NSA):
        part = pool.pools.get(c)
        if part is None:
            continue
        _, items = part.held(kv)
        if c is not Component.MAMBA:
            items = items[prefix_len // pool.page_size:]
        if c is Component.MAMBA:
            buf, item, offset = part.storage.buffers[-1], int(items[0]), -1
        else:
            buf, item, offset = part.storage.buffers[0], int(items[0]), 1
        buf[item, offset] ^= FLIP
        return f"{c.value} item {item}, byte {offset % buf.shape[1]} of buffer row"
    raise ValueError("the pool holds no component decode.flip can corrupt")
