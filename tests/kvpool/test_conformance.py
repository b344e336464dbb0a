"""Every pool class implements the one KVPool interface, with the same signatures, and works
through all of it."""

import inspect

import numpy as np
import pytest
import torch

from kvpool import Component, HybridPool, KVPool, Layout, PoolConfig, get_preset
from kvpool.components import SPECS, Items
from kvpool.errors import LayoutMismatch
from kvpool.indices import INDEX_DTYPE
from kvpool.pools import AuxPool, FullPool, MambaPool, NSAPool, SWAPool
from kvpool.pools.base import ComponentPool

from tests.kvpool.helpers import assert_same, fill_random, read_held

POOL_CLASSES = [FullPool, SWAPool, NSAPool, MambaPool, AuxPool, HybridPool]
INTERFACE = [name for name, m in inspect.getmembers(KVPool) if getattr(m, "__isabstractmethod__", False)]


def _all_subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _all_subclasses(sub)


def test_every_pool_class_is_listed():
    """Every instantiable pool (a component pool names its component) is in POOL_CLASSES."""
    concrete = {
        c
        for c in _all_subclasses(KVPool)
        if not inspect.isabstract(c) and (getattr(c, "component", None) is not None or c is HybridPool)
    }
    assert concrete == set(POOL_CLASSES)


@pytest.mark.parametrize("cls", POOL_CLASSES)
@pytest.mark.parametrize("method", INTERFACE)
def test_signatures_match_the_interface(cls, method):
    """A subclass cannot drift: same parameter names, kinds, annotations; no **kwargs."""
    base = inspect.signature(getattr(KVPool, method))
    sig = inspect.signature(getattr(cls, method))
    assert sig == base, f"{cls.__name__}.{method}{sig} != KVPool.{method}{base}"
    assert all(p.kind is not p.VAR_KEYWORD for p in sig.parameters.values())


def test_a_component_is_its_spec():
    """A pool component is one object (kvpool.components): the HybridPool builds each
    component's pool through its spec, the pool's rows are the spec's segments, and how many
    items it has follows the kind of item the spec names."""
    cfg = PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=64, max_requests=3)
    pool = HybridPool(cfg)
    assert list(SPECS) == list(Component) and list(pool.pools) == list(Component)
    for c, part in pool.pools.items():
        spec = SPECS[c]
        assert spec.component is c and part.component is c
        assert [p.segment for p in part.storage.packed.placements] == spec.segments(cfg.model, 4, 1)
        assert part.storage.num_items == cfg.sizes().count(spec.items) + 1
        assert c.per_request == (spec.items is Items.REQUEST_SLOTS)
    assert [c for c in Component if c.truncatable] == [Component.SWA, Component.NSA]
    assert [c for c in Component if c.sent_last] == [Component.AUX]


def test_missing_method_cannot_instantiate():
    class Broken(ComponentPool):
        component = Component.FULL

        def held(self, req):
            raise AssertionError

    with pytest.raises(TypeError, match="abstract"):
        Broken(PoolConfig(get_preset("tiny-full"), 4, max_tokens=64), 17)


def _pools(pool: HybridPool):
    return [pool, *pool.pools.values()]


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("preset", ["tiny-full", "tiny-swa", "tiny-mla-nsa", "tiny-mamba", "tiny-hybrid"])
def test_whole_interface(preset, layout, device):
    cfg = PoolConfig(get_preset(preset), 4, max_tokens=256, max_requests=4, layout=layout, device=device)
    pool = HybridPool(cfg)
    req = pool.alloc_request(23)
    written = fill_random(pool, req, seed=1)
    seen_classes = set()
    for p in _pools(pool):
        seen_classes.add(type(p))
        # buffer descriptors: real, disjoint ranges of whole items
        descs = p.buffer_descriptors()
        assert descs
        for d in descs:
            assert d.nbytes % d.item_bytes == 0 and d.ptr > 0
        # index sets: int32, read-only, no sentinel
        iset = p.index_set(req)
        for c, idx in iset.by_component.items():
            assert idx.dtype == INDEX_DTYPE and not idx.flags.writeable
            assert (idx != 0).all(), f"{c.value} index set contains the sentinel"
        # CPU copy round trip into a fresh allocation
        copy = p.get_cpu_copy(req)
        assert all(t.device.type == "cpu" for part in copy.components.values() for t in part.buffers)
        other = pool.alloc_request(23)
        p.load_cpu_copy(other, copy)
        for c in copy.components:
            got = pool.pools[c].storage.gather(pool.pools[c].held(other)[1])
            for x, y in zip(got, written[c]):
                assert torch.equal(x, y)
        pool.free_request(other)
    assert seen_classes == {HybridPool} | {type(p) for p in pool.pools.values()}
    # per-layer views exist for every layer that holds KV
    kinds = cfg.model.layer_kinds()
    for layer, kind in enumerate(kinds):
        parts = {"full": ["k", "v"], "swa": ["k", "v"], "mla": ["latent"], "linear": ["conv", "temporal"]}.get(kind, [])
        for part in parts:
            v = pool.layer_view(layer, part)
            assert v.device.type == torch.device(device).type and v.shape[0] > 1
    with pytest.raises(LayoutMismatch):
        pool.layer_view(99, "k")
    pool.free_request(req)
    pool.check_integrity()


def test_load_refuses_a_copy_that_does_not_fit(device):
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=4, device=device))
    req = pool.alloc_request(23)
    fill_random(pool, req, seed=2)
    copy = pool.get_cpu_copy(req)
    other = pool.alloc_request(31)
    before = read_held(pool, other)
    with pytest.raises(LayoutMismatch, match="23 tokens"):
        pool.load_cpu_copy(other, copy)
    assert_same(read_held(pool, other), before)  # nothing written
    # a copy whose SWA positions differ (window-only allocation) is refused, also unwritten
    narrow = pool.alloc_request(23, swa_window_only=True)
    before = read_held(pool, narrow)
    with pytest.raises(LayoutMismatch, match="swa"):
        pool.load_cpu_copy(narrow, copy)
    assert_same(read_held(pool, narrow), before)
    # and a copy from another model
    foreign = HybridPool(PoolConfig(get_preset("tiny-full"), 4, max_tokens=256, device=device))
    freq = foreign.alloc_request(23)
    with pytest.raises(LayoutMismatch):
        pool.load_cpu_copy(req, foreign.get_cpu_copy(freq))


def test_freed_request_is_refused_everywhere():
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=4))
    req = pool.alloc_request(10)
    pool.free_request(req)
    for call in (
        lambda: pool.free_request(req),
        lambda: pool.index_set(req),
        lambda: pool.get_cpu_copy(req),
        lambda: pool.extend(req, 20),
        lambda: pool.evict_swa(req),
    ):
        with pytest.raises(Exception, match="already freed"):
            call()
    pool.check_integrity()
    assert pool.available()["full_tokens"] == 256


def test_index_set_components(device):
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=4, device=device))
    req = pool.alloc_request(23)  # 6 pages, window 6 -> tokens 17..22 -> pages 4..5
    iset = pool.index_set(req)
    assert set(iset.components()) == set(pool.pools)
    assert np.array_equal(iset[Component.FULL], req.full_pages)
    assert np.array_equal(iset[Component.NSA], req.full_pages)
    assert len(iset[Component.SWA]) == 2
    assert iset[Component.MAMBA].tolist() == [req.state_slot]
    assert iset[Component.AUX].tolist() == [req.aux_row]
