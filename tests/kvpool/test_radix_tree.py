"""The prefix cache's radix tree against a plain dict model (prefix of whole pages -> page),
under random inserts, matches, uses and evictions; and with a hash that collides all the time,
where it may cache less but never hands out another prefix's pages."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kvpool.cache import tree as tree_module
from kvpool.cache.blocks import page_keys
from kvpool.cache.tree import RadixTree

PAGE = 2
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=14)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), seqs),
        st.tuples(st.just("match"), seqs, st.integers(0, 8)),
        st.tuples(st.just("release"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(1, 6)),
    ),
    min_size=1,
    max_size=40,
)


class Model:
    """What the tree must answer: each cached prefix (a tuple of page blocks) and its page."""

    def __init__(self):
        self.pages: dict[tuple, int] = {}
        self.next_page = 1

    def prefix(self, blocks: list[tuple], most: int) -> list[int]:
        out = []
        for i in range(min(most, len(blocks))):
            page = self.pages.get(tuple(blocks[: i + 1]))
            if page is None:
                break
            out.append(page)
        return out


def blocks_of(seq: list[int]) -> list[tuple]:
    return [tuple(seq[i : i + PAGE]) for i in range(0, len(seq) - len(seq) % PAGE, PAGE)]


def run(ops_list, exact: bool) -> None:
    t, m = RadixTree(PAGE), Model()
    held: list[tuple] = []  # (node, the pages its match named)
    for op in ops_list:
        if op[0] == "insert":
            seq, blocks = op[1], blocks_of(op[1])
            pages = np.arange(m.next_page, m.next_page + len(blocks), dtype=np.int32)
            m.next_page += len(blocks)
            cached = len(m.prefix(blocks, len(blocks)))
            taken = t.insert(np.array(seq, dtype=np.int64), pages)
            if exact:
                assert list(taken) == list(pages[cached:])
            else:
                assert len(taken) == 0 or list(taken) == list(pages[cached:])
            for i in range(len(blocks) - len(taken), len(blocks)):
                m.pages[tuple(blocks[: i + 1])] = int(pages[i])
        elif op[0] == "match":
            seq, most = op[1], op[2]
            got = t.match(np.array(seq, dtype=np.int64), most)
            want = m.prefix(blocks_of(seq), most)
            assert list(got.pages) == want[: got.num_pages]
            if exact:
                assert got.num_pages == len(want)
            t.acquire(got.node)
            held.append((got.node, list(got.pages)))
        elif op[0] == "release" and held:
            node, _ = held.pop(op[1] % len(held))
            t.release(node)
        elif op[0] == "evict":
            in_use = {p for _, pages in held for p in pages}
            unused_before = len(t.pages(unused_only=True))
            gone = set(int(p) for p in t.evict(op[1]))
            assert not gone & in_use, "evicted a page a request uses"
            assert len(gone) >= min(op[1], unused_before)
            m.pages = {k: v for k, v in m.pages.items() if v not in gone}
            assert all(k[:-1] in m.pages or len(k) == 1 for k in m.pages), "what stays is not prefix-closed"
        t.check()
        assert sorted(int(p) for p in t.pages()) == sorted(m.pages.values())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_list=ops)
def test_tree_matches_the_dict_model(ops_list):
    run(ops_list, exact=True)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops_list=ops)
def test_colliding_keys_cost_misses_never_wrong_pages(ops_list, monkeypatch_module):
    run(ops_list, exact=False)


@pytest.fixture(scope="module")
def monkeypatch_module():
    """Every block's key is the sum of its ids mod 2: siblings collide all the time."""
    mp = pytest.MonkeyPatch()
    mp.setattr(tree_module, "page_keys", lambda tokens, page: page_keys(tokens, page) % np.uint64(2))
    yield
    mp.undo()


def test_keys_are_per_page_and_vectorized():
    tokens = np.arange(64, dtype=np.int64) % 7
    keys = page_keys(tokens, 8)
    assert keys.dtype == np.uint64 and len(keys) == 8
    assert keys[0] == keys[7] and len(set(keys.tolist())) == 7  # the same block, the same key anywhere
    assert len(page_keys(tokens[:15], 8)) == 1  # a partial page has none
