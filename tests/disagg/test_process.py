"""disagg.process: what every long-running process does around its main loop."""

import gc
import weakref

import pytest

from disagg.process import freeze_heap


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # (the test process's own heap goes back to the collector)


class _Node:
    pass


def test_freeze_heap_takes_what_exists_out_of_the_collector_and_still_collects_later_cycles(unfrozen):
    kept = [_Node() for _ in range(100)]
    frozen = freeze_heap()
    assert frozen >= len(kept)  # (not == get_freeze_count() later: other tests' threads may free frozen objects)
    collected = {id(o) for o in gc.get_objects()}  # (the three generations; frozen ones are in none)
    assert not any(id(k) in collected for k in kept)

    a, b = _Node(), _Node()
    a.other, b.other = b, a  # a cycle made after start-up: only the collector frees it
    gone = weakref.ref(a)
    del a, b
    gc.collect()
    assert gone() is None
