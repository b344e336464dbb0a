"""Page-major vs layer-major: where bytes live, what views alias, how many ranges a page costs."""

import pytest
import torch

from kvpool import Component, HybridPool, Layout, PoolConfig, get_preset
from kvpool.layout import ALIGN, pack
from kvpool.geometry import segments


@pytest.mark.parametrize("preset", ["gpt-oss-120b", "deepseek-v3.2", "qwen3-next-80b-a3b", "mimo-v2-flash"])
def test_page_major_needs_one_range_per_page_and_component(preset):
    model = get_preset(preset)
    for c in (Component.FULL, Component.SWA, Component.NSA, Component.MAMBA):
        try:
            segs = segments(model, c, model.default_page_size)
        except Exception:
            continue
        pm, lm = pack(segs, Layout.PAGE_MAJOR), pack(segs, Layout.LAYER_MAJOR)
        assert len(pm.item_bytes) == 1 and len(lm.item_bytes) == len(segs)
        payload = sum(s.nbytes for s in segs)
        assert payload <= pm.row_bytes < payload + ALIGN * len(segs)
        assert lm.row_bytes == payload
        offsets = [p.offset for p in pm.placements]
        assert offsets == sorted(offsets) and all(o % ALIGN == 0 for o in offsets)


@pytest.mark.parametrize("layout", list(Layout))
def test_views_alias_the_registered_bytes(layout, device):
    """Writing through a per-layer view changes exactly the bytes the layout says, in the
    buffer and item the descriptors name."""
    cfg = PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=64, max_requests=2, layout=layout, device=device)
    pool = HybridPool(cfg)
    for p in pool.pools.values():
        for pl in p.storage.packed.placements:
            seg = pl.segment
            view = p.layer_view(seg.layer, seg.part)
            assert tuple(view.shape) == (p.storage.num_items, *seg.shape)
            item = p.storage.num_items - 1
            raw = p.storage.buffers[pl.buffer]
            before = raw.clone()
            view[item].view(torch.uint8).fill_(0xAB)
            changed = (raw != before).nonzero()
            assert changed[:, 0].unique().tolist() == [item]
            cols = changed[:, 1]
            assert cols.min().item() == pl.offset and cols.max().item() == pl.offset + seg.nbytes - 1
            assert len(cols) == seg.nbytes
            raw.copy_(before)


def test_descriptors_cover_every_buffer_once():
    for layout in Layout:
        pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=64, max_requests=2, layout=layout))
        descs = pool.buffer_descriptors()
        spans = sorted((d.ptr, d.ptr + d.nbytes) for d in descs)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "buffers overlap"
        n_segments = sum(len(p.storage.packed.placements) for p in pool.pools.values())
        assert len(descs) == (len(pool.pools) if layout is Layout.PAGE_MAJOR else n_segments)
        if layout is Layout.PAGE_MAJOR:
            assert all(d.layer is None and d.part is None for d in descs)
        else:
            assert all(d.layer is not None and d.part is not None for d in descs if d.component is not Component.AUX)


def test_layouts_hold_the_same_values():
    """The same per-layer writes read back identically from both layouts."""
    pools = [
        HybridPool(PoolConfig(get_preset("tiny-mamba"), 4, max_tokens=64, max_requests=2, layout=lay)) for lay in Layout
    ]
    gen = torch.Generator().manual_seed(0)
    for layer, part in [(3, "k"), (3, "v"), (0, "conv"), (2, "temporal")]:
        ref = pools[0].layer_view(layer, part)
        data = torch.randn(ref.shape, generator=gen).to(ref.dtype)
        for p in pools:
            p.layer_view(layer, part).copy_(data)
        assert torch.equal(pools[0].layer_view(layer, part), pools[1].layer_view(layer, part))
