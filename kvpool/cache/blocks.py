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


_R = np.uint64(0x9E3779B97F4A7C15)  # odd: every page position weighs differently


@functools.lru_cache(maxsize=64)
def _powers(n: int) -> np.ndarray:
    """R^0 .. R^(n-1) (wrapping uint64): the weight of each page position in a chain."""
    with np.errstate(over="ignore"):
        out = np.cumprod(np.concatenate([[np.uint64(1)], np.full(max(0, n - 1), _R, np.uint64)]), dtype=np.uint64)
    out.setflags(write=False)
    return out[:n]


def _finalize(h: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        h = h ^ (h >> np.uint64(30))
        h = h * _M1
        h ^= h >> np.uint64(27)
        h *= _M2
        h ^= h >> np.uint64(31)
    return h


def chain_keys(tokens: np.ndarray, page_size: int) -> np.ndarray:
    """uint64 [whole pages]: page i's key chained over pages 0..i, so equal values mean equal
    prefixes (up to a 64-bit collision), not just equal pages. What a decode worker publishes of
    its cache and what the router computes from a request's token ids to look it up
    (disagg/router/cache_index.py): the same function of (token ids, page size) in every
    process. A position-weighted sum of the page keys (cumsum: no loop over pages), finalized."""
    keys = page_keys(np.asarray(tokens), page_size)
    pows = _powers(1 << max(0, int(len(keys) - 1).bit_length()))[: len(keys)]
    with np.errstate(over="ignore"):
        sums = np.cumsum(keys * pows, dtype=np.uint64)
    return _finalize(sums)
