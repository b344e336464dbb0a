"""What decode's prefix cache publishes for the router (issue 39, KV-aware routing): chained
page keys a reader computes from token ids alone, every page kept or evicted as a journal
entry, and a reader that applies the changes since its last look holds exactly what the cache
holds, through eviction, a reader that fell behind, and a dropped cache."""

import numpy as np
import pytest

from kvpool import HybridPool, PoolConfig, get_preset
from kvpool.cache.blocks import chain_keys, page_keys
from kvpool.cache.journal import Journal
from kvpool.cache.prefix import PrefixCache


def test_a_chained_key_covers_its_whole_prefix():
    a = np.arange(64)
    b = a.copy()
    b[0] = 999  # only the first page differs
    ka, kb = chain_keys(a, 16), chain_keys(b, 16)
    assert len(ka) == 4 and (ka != kb).all()  # every later page's key differs too
    assert (page_keys(a, 16)[1:] == page_keys(b, 16)[1:]).all()  # (the page keys alone do not)
    assert np.array_equal(chain_keys(np.r_[a, [5] * 20], 16)[:4], ka)  # a longer prompt: same leading keys
    assert len(chain_keys(a[:15], 16)) == 0  # no whole page, no key
    assert np.array_equal(chain_keys(a.tolist(), 16), ka)  # lists (the router's token ids) alike
    swapped = np.r_[a[16:32], a[:16], a[32:]]
    assert chain_keys(swapped, 16)[1] != ka[1]  # the order of pages counts


def test_the_journal_answers_net_changes_or_asks_for_everything():
    j = Journal(keep=6)
    assert j.since(None) is None and j.since(0).seq == 0
    j.record(True, np.array([1, 2, 3], np.uint64))
    j.record(False, np.array([2], np.uint64))
    j.record(True, np.array([2, 4], np.uint64))  # evicted, then back
    c = j.since(0)
    assert c.seq == 3 and sorted(c.added.tolist()) == [1, 2, 3, 4] and c.evicted.tolist() == []
    c = j.since(1)
    assert sorted(c.added.tolist()) == [2, 4] and c.evicted.tolist() == []
    j.record(False, np.array([1, 3], np.uint64))  # 8 keys kept > 6: the first entry goes
    assert j.since(0) is None  # fell behind: start again
    assert j.since(1) is not None and j.since(4).added.tolist() == []
    assert j.since(5) is None  # ahead of us: not ours (a restart)


def make(max_tokens: int = 256) -> PrefixCache:
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=max_tokens, max_requests=8, device="cpu"))
    return PrefixCache(pool)


def turn(cache: PrefixCache, prompt: np.ndarray, new: int, rng) -> np.ndarray:
    kv, hit = cache.admit(prompt, grow_to=len(prompt) + new)
    held = np.concatenate([prompt, rng.integers(0, 1000, new)])
    for t in range(len(prompt) + 1, len(held) + 1):
        cache.pool.extend(kv, t)
    cache.release(kv, hit, held)
    return held


class Reader:
    """The router's side in miniature: applies what it is told."""

    def __init__(self):
        self.seq, self.keys = None, set()

    def look(self, cache: PrefixCache) -> dict:
        got = cache.published(self.seq)
        if got["reset"]:
            self.keys = set(got["added"])
        else:
            self.keys = (self.keys - set(got["evicted"])) | set(got["added"])
        self.seq = got["seq"]
        return got


def held_keys(cache: PrefixCache) -> set[int]:
    return set(cache.published(None)["added"])


def test_a_kept_turn_publishes_the_keys_of_its_whole_pages():
    cache, rng = make(), np.random.default_rng(0)
    reader = Reader()
    assert reader.look(cache)["reset"] and reader.keys == set()
    held = turn(cache, rng.integers(0, 1000, 37), 6, rng)  # 43 positions: 10 whole pages
    got = reader.look(cache)
    assert not got["reset"] and got["page_size"] == 4 and got["evicted"] == []
    assert sorted(got["added"]) == sorted(chain_keys(held, 4)[:10].view(np.int64).tolist())
    more = turn(cache, np.r_[held, rng.integers(0, 1000, 9)], 3, rng)  # the conversation goes on
    got = reader.look(cache)
    assert sorted(got["added"]) == sorted(
        chain_keys(more, 4)[10 : len(more) // 4].view(np.int64).tolist()
    )  # the new tail only


@pytest.mark.parametrize("keep", [1 << 16, 8])  # 8: the reader falls behind and starts again
def test_a_reader_holds_what_the_cache_holds_through_eviction(keep):
    cache, rng = make(max_tokens=128), np.random.default_rng(1)
    cache.journal.keep = keep
    reader, shared = Reader(), rng.integers(0, 1000, 16)
    resets = 0
    for i in range(30):
        turn(cache, np.r_[shared, rng.integers(0, 1000, int(rng.integers(5, 40)))], 4, rng)
        if i % 3 == 0:
            resets += reader.look(cache)["reset"]
            assert reader.keys == held_keys(cache)
    assert cache.evicted_pages > 0
    assert cache.drop() > 0
    reader.look(cache)
    assert reader.keys == set() == held_keys(cache)
    assert (resets > 1) == (keep == 8)
