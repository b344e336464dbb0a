"""CPU copy -> restore round-trips byte-exactly, for every preset family and both layouts."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool import HybridPool, Layout, OutOfSpace, PoolConfig, get_preset

from tests.kvpool.helpers import assert_same, fill_random, read_held

FAMILIES = [
    "tiny-full",
    "tiny-swa",
    "tiny-mla-nsa",
    "tiny-mamba",
    "tiny-hybrid",
    "gpt-oss-20b",
    "deepseek-v3.2",
    "qwen3-next-80b-a3b",
]


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("preset", FAMILIES)
def test_retract_restore_round_trip(preset, layout, device):
    model = get_preset(preset)
    tiny = preset.startswith("tiny-")
    cfg = PoolConfig(
        model,
        model.default_page_size,
        tp_size=1 if tiny else 2,
        max_tokens=4096 if tiny else 1024,
        max_requests=3,
        layout=layout,
        device=device,
    )
    pool = HybridPool(cfg)
    initial = pool.available()
    req = pool.alloc_request(300 if not tiny else 37)
    pool.extend(req, req.num_tokens + 5)  # evicts SWA pages that left the window
    written = fill_random(pool, req, seed=7)
    copy = pool.retract(req)
    assert pool.available() == initial
    # someone else takes (and dirties) the freed pages meanwhile
    squatter = pool.alloc_request(req.num_tokens)
    fill_random(pool, squatter, seed=8)
    restored = pool.restore(copy)
    assert restored.num_tokens == req.num_tokens
    assert_same(read_held(pool, restored), written)
    pool.free_request(restored)
    pool.free_request(squatter)
    assert pool.available() == initial
    pool.check_integrity()


def test_restore_without_space_takes_nothing():
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=64, max_requests=2))
    req = pool.alloc_request(30)
    pool.evict_swa(req)
    copy = pool.retract(req)
    hog = pool.alloc_request(60, swa_window_only=True)  # 15 of 16 full pages
    before = pool.available()
    with pytest.raises(OutOfSpace):
        pool.restore(copy)
    assert pool.available() == before
    pool.free_request(hog)
    pool.check_integrity()


class HybridLifecycle(RuleBasedStateMachine):
    """Random alloc/extend/evict/retract/restore/free on a tiny hybrid pool: integrity holds,
    every live request keeps exactly the bytes written to it, and freeing all returns the pool
    to its initial free counts."""

    def __init__(self):
        super().__init__()
        self.pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=160, max_requests=4))
        assert self.pool.config.model.swa.window == 6 and self.pool.page_size == 4
        self.initial = self.pool.available()
        self.live = []  # (req, written)
        self.parked = []  # KVCopy
        self.seed = 0

    def _fill(self, req):
        self.seed += 1
        return fill_random(self.pool, req, self.seed)

    @rule(tokens=st.integers(1, 60), window_only=st.booleans())
    def alloc(self, tokens, window_only):
        try:
            req = self.pool.alloc_request(tokens, swa_window_only=window_only)
        except OutOfSpace:
            return
        self.live.append((req, self._fill(req)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99), extra=st.integers(1, 12))
    def extend(self, i, extra):
        req, _ = self.live[i % len(self.live)]
        try:
            self.pool.extend(req, req.num_tokens + extra)
        except OutOfSpace:
            pass
        else:  # extend evicts everything out of the window
            assert req.swa_evicted == max(0, req.num_tokens - 6) // 4
        self.live[i % len(self.live)] = (req, self._fill(req))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def retract(self, i):
        req, written = self.live.pop(i % len(self.live))
        assert_same(read_held(self.pool, req), written)
        self.parked.append(self.pool.retract(req))

    @precondition(lambda self: self.parked)
    @rule(i=st.integers(0, 99))
    def restore(self, i):
        copy = self.parked[i % len(self.parked)]
        try:
            req = self.pool.restore(copy)
        except OutOfSpace:
            return
        del self.parked[i % len(self.parked)]
        self.live.append((req, read_held(self.pool, req)))
        for c, part in copy.components.items():
            for x, y in zip(part.buffers, self.live[-1][1][c]):
                assert (x == y).all()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        req, written = self.live.pop(i % len(self.live))
        assert_same(read_held(self.pool, req), written)
        self.pool.free_request(req)

    @invariant()
    def integrity(self):
        self.pool.check_integrity()
        for req, _ in self.live:  # SWA pages back exactly positions >= the eviction frontier
            backed = self.pool.swa_allocator.translate(req.full_pages) != 0
            assert (backed == (np.arange(req.num_pages) >= req.swa_evicted)).all()
            assert req.swa_evicted <= max(0, req.num_tokens - 6) // 4

    def teardown(self):
        for req, _ in self.live:
            self.pool.free_request(req)
        assert self.pool.available() == self.initial


TestHybridLifecycle = HybridLifecycle.TestCase
TestHybridLifecycle.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
