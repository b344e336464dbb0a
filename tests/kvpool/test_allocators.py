import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.allocator import PagedAllocator, StateSlotAllocator, SWAAllocator, TokenAllocator
from kvpool.errors import AllocatorError, OutOfSpace


def test_fresh_allocator_never_hands_out_sentinel():
    a = StateSlotAllocator(8)
    ids = a.alloc(8)
    assert sorted(ids.tolist()) == list(range(1, 9))
    assert ids.dtype == np.int32 and not ids.flags.writeable
    with pytest.raises(OutOfSpace):
        a.alloc(1)
    a.check_integrity()


@pytest.mark.parametrize(
    "bad,message",
    [
        ([0], "padding sentinel"),
        ([9], "not from this allocator"),
        ([-1], "padding sentinel|not from"),
        ([3, 3], "duplicate"),
        ([5], "double free"),
    ],
)
def test_bad_frees_are_rejected_and_change_nothing(bad, message):
    a = StateSlotAllocator(8)
    a.alloc(4)  # 1..4 in use
    before = (a.available_size(), a._stack.copy(), a._is_free.copy())
    with pytest.raises(AllocatorError, match=message):
        a.free(np.array(bad, dtype=np.int32))
    assert a.available_size() == before[0]
    assert np.array_equal(a._stack, before[1]) and np.array_equal(a._is_free, before[2])
    a.check_integrity()


def test_double_free_after_free():
    a = StateSlotAllocator(4)
    ids = a.alloc(2)
    a.free(ids)
    with pytest.raises(AllocatorError, match="double free"):
        a.free(ids)


def test_free_refuses_non_integer_and_overflowing_indices():
    a = StateSlotAllocator(4)
    a.alloc(2)
    with pytest.raises(AllocatorError, match="integers"):
        a.free(np.array([1.0]))
    with pytest.raises(AllocatorError, match="int32"):
        a.free(np.array([2**40], dtype=np.int64))


def test_paged_and_token_allocators_count_tokens():
    p = PagedAllocator(10, 16)
    assert p.available_size() == 160
    pages = p.alloc_tokens(33)
    assert len(pages) == 3 and p.available_size() == 112
    assert len(p.alloc_extend(33, 48)) == 0 and len(p.alloc_extend(48, 49)) == 1
    with pytest.raises(AllocatorError, match="cannot extend"):
        p.alloc_extend(49, 10)
    t = TokenAllocator(5)
    assert len(t.alloc_tokens(5)) == 5 and t.available_size() == 0
    with pytest.raises(Exception, match="power of two"):
        PagedAllocator(10, 6)


def test_swa_translate_is_pure_and_padding_maps_to_sentinel():
    swa = SWAAllocator(PagedAllocator(16, 4, "full"), PagedAllocator(8, 4, "swa"))
    pages = swa.alloc(4, swa_first=2)
    t = swa.translate(pages)
    assert (t[:2] == 0).all() and (t[2:] != 0).all()
    padded = np.concatenate([pages, np.zeros(3, dtype=np.int32)])
    assert (swa.translate(padded)[4:] == 0).all()
    # the same input after a change to the mapping gives the new answer (no memo)
    swa.evict(pages[2:3])
    assert swa.translate(pages)[2] == 0 and swa.translate(pages)[3] == t[3]
    with pytest.raises(AllocatorError, match="swa_first"):
        swa.alloc(2, swa_first=3)
    with pytest.raises(AllocatorError, match="full pages must lie"):
        swa.translate(np.array([17], dtype=np.int32))
    swa.check_integrity()


def test_swa_alloc_is_all_or_nothing():
    swa = SWAAllocator(PagedAllocator(16, 4, "full"), PagedAllocator(2, 4, "swa"))
    with pytest.raises(OutOfSpace, match="swa"):
        swa.alloc(4, swa_first=0)
    assert swa.full.num_free == 16 and swa.swa.num_free == 2
    swa.check_integrity()


def test_swa_free_releases_backing_pages_and_rejects_foreign():
    swa = SWAAllocator(PagedAllocator(8, 4, "full"), PagedAllocator(8, 4, "swa"))
    pages = swa.alloc(3, swa_first=0)
    swa.evict(pages[:1])
    swa.free(pages)
    assert swa.full.num_free == 8 and swa.swa.num_free == 8
    with pytest.raises(AllocatorError):
        swa.free(pages)
    with pytest.raises(AllocatorError):
        swa.evict(pages)
    swa.check_integrity()


class SlotMachine(RuleBasedStateMachine):
    """Random alloc/free/extend sequences against a model of which ids are live."""

    def __init__(self):
        super().__init__()
        self.alloc = PagedAllocator(64, 4)
        self.live: list[np.ndarray] = []

    @rule(n=st.integers(0, 20))
    def allocate(self, n):
        if n > self.alloc.num_free:
            with pytest.raises(OutOfSpace):
                self.alloc.alloc(n)
            return
        ids = self.alloc.alloc(n)
        taken = np.concatenate(self.live) if self.live else np.zeros(0, np.int32)
        assert not np.isin(ids, taken).any(), "an id was handed out twice"
        assert (ids != 0).all(), "sentinel handed out"
        self.live.append(ids)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def free(self, i):
        self.alloc.free(self.live.pop(i % len(self.live)))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000), extra=st.integers(1, 12))
    def extend(self, i, extra):
        k = i % len(self.live)
        cur = len(self.live[k]) * 4
        if self.alloc.num_free * 4 >= extra:
            new = self.alloc.alloc_extend(cur, cur + extra)
            self.live[k] = np.concatenate([self.live[k], new])

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def double_free_is_refused(self, i):
        ids = self.live.pop(i % len(self.live))
        self.alloc.free(ids)
        if len(ids):
            with pytest.raises(AllocatorError):
                self.alloc.free(ids)

    @invariant()
    def integrity(self):
        self.alloc.check_integrity()
        held = sum(len(x) for x in self.live)
        assert held + self.alloc.num_free == 64


class SWAMachine(RuleBasedStateMachine):
    """Random alloc/extend-with-eviction/free for the full+SWA pair."""

    WINDOW, PAGE = 6, 4

    def __init__(self):
        super().__init__()
        self.swa = SWAAllocator(PagedAllocator(48, self.PAGE, "full"), PagedAllocator(16, self.PAGE, "swa"))
        self.reqs: list[tuple[np.ndarray, int]] = []

    def _first(self, tokens):
        return max(0, tokens - self.WINDOW) // self.PAGE

    @rule(tokens=st.integers(1, 40), window_only=st.booleans())
    def allocate(self, tokens, window_only):
        n = -(-tokens // self.PAGE)
        first = self._first(tokens) if window_only else 0
        if n > self.swa.full.num_free or n - first > self.swa.swa.num_free:
            with pytest.raises(OutOfSpace):
                self.swa.alloc(n, first)
            return
        pages = self.swa.alloc(n, first)
        assert ((self.swa.translate(pages) != 0) == (np.arange(n) >= first)).all()
        self.reqs.append((pages, tokens))

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 1000), extra=st.integers(1, 9))
    def grow_and_evict(self, i, extra):
        k = i % len(self.reqs)
        pages, tokens = self.reqs[k]
        new_tokens = tokens + extra
        n_new = -(-new_tokens // self.PAGE) - len(pages)
        self.swa.evict(pages[: self._first(new_tokens)])
        if n_new > self.swa.full.num_free or n_new > self.swa.swa.num_free:
            return
        pages = np.concatenate([pages, self.swa.alloc(n_new, 0)])
        self.reqs[k] = (pages, new_tokens)
        backed = self.swa.translate(pages) != 0
        assert not backed[: self._first(new_tokens)].any(), "an out-of-window page kept its SWA page"

    @precondition(lambda self: self.reqs)
    @rule(i=st.integers(0, 1000))
    def free(self, i):
        pages, _ = self.reqs.pop(i % len(self.reqs))
        self.swa.free(pages)

    @invariant()
    def integrity(self):
        self.swa.check_integrity()
        held = sum(len(p) for p, _ in self.reqs)
        assert held + self.swa.full.num_free == 48


TestSlotMachine = SlotMachine.TestCase
TestSlotMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestSWAMachine = SWAMachine.TestCase
TestSWAMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
