"""CUDA-only checks: pools live in device memory, views feed device kernels, and the CPU copy
round trip crosses the device boundary."""

import pytest
import torch

from kvpool import Component, HybridPool, Layout, PoolConfig, get_preset

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("layout", list(Layout))
def test_pool_lives_on_the_gpu(layout):
    cfg = PoolConfig(get_preset("gpt-oss-20b"), 16, byte_budget=256 << 20, max_requests=4, layout=layout, device="cuda")
    pool = HybridPool(cfg)
    for d in pool.buffer_descriptors():
        assert d.ptr % 256 == 0 or layout is Layout.LAYER_MAJOR  # one cudaMalloc'd block each
    for layer in (0, 1):
        for part in ("k", "v"):
            v = pool.layer_view(layer, part)
            assert v.is_cuda and v.data_ptr() % 16 == 0
    req = pool.alloc_request(1000)
    # an engine-style scatter of new K values through the view, by page index tensor on device
    pages = torch.from_numpy(req.full_pages.astype("int64")).cuda()
    k = pool.layer_view(1, "k")
    vals = torch.randn((len(pages), *k.shape[1:]), device="cuda", dtype=k.dtype)
    k[pages] = vals
    copy = pool.retract(req)
    assert all(t.device.type == "cpu" for p in copy.components.values() for t in p.buffers)
    k.zero_()
    req = pool.restore(copy)
    pages = torch.from_numpy(req.full_pages.astype("int64")).cuda()
    assert torch.equal(pool.layer_view(1, "k")[pages], vals)
    assert len(pool.index_set(req)[Component.SWA]) == 9  # window 128 at page 16 -> 8 pages + 1
    pool.free_request(req)
    pool.check_integrity()
