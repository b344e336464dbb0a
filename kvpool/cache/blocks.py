"""Page-block keys: one 64-bit hash of each whole page's token ids, for every page at once.

A key only finds a child in the radix tree (kvpool.cache.tree); the tree then compares the
token ids themselves, so two blocks whose keys collide never share KV. The hash is a fixed
random linear form over the page's token ids (wrapping uint64 arithmetic) followed by a
finalizer: one numpy expression over [pages, page_size], no loop over tokens.
"""

import functools

import numpy as np

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


@functools.lru_cache(maxsize=None)
def _weights(page_size: int) -> np.ndarray:
    """Fixed odd uint64 weights, one per slot of a page (the same in every process)."""
    w = np.random.default_rng(0x5EED + page_size).integers(0, 2**63, page_size, dtype=np.uint64)
    out = w * np.uint64(2) + np.uint64(1)
    out.setflags(write=False)
    return out


def page_blocks(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """int64 [whole pages, page_size]: the token ids of each whole page (a partial last page
    has none)."""
    m = len(tokens) // page_size
    return np.asarray(tokens[: m * page_size], dtype=np.int64).reshape(m, page_size)


def page_keys(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """uint64 [whole pages]: the key of each whole page of `tokens`, independent of where the
    page lies (the tree's path gives the position)."""
    blocks = page_blocks(tokens, page_size).view(np.uint64)
    with np.errstate(over="ignore"):
        h = (blocks * _weights(page_size)[None, :]).sum(axis=1, dtype=np.uint64)
        h ^= h >> np.uint64(30)
        h *= _M1
        h ^= h >> np.uint64(27)
        h *= _M2
        h ^= h >> np.uint64(31)
    return h
