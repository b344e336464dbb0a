"""vLLM's per-layer KV tensors described as transfer buffers: one layer-major buffer per layer,
an item per block, same memory; layouts whose blocks are not back to back are refused by name."""

import pytest
import torch

from disagg.vllm.layout import PART, VllmLayoutError, buffers, describe
from kvpool.geometry import Component
from transfer.buffers import layout_difference


def _cpu_caches(num_blocks=8, heads=2, block=16, head=64, dtype=torch.float32, layers=(1, 0)):
    """vLLM's CPU layout: [num_blocks, num_kv_heads, block_size, 2 * head_size] per layer."""
    return {f"model.layers.{i}.self_attn.attn": torch.randn(num_blocks, heads, block, 2 * head, dtype=dtype)
            for i in layers}


def test_cpu_layout_is_one_buffer_per_layer_with_a_block_per_item():
    caches = _cpu_caches()
    layers = describe(caches)
    assert [b.layer for b in layers] == [0, 1]
    bufs = buffers(layers)
    assert [(b.region, b.item_bytes, b.num_items, b.component, b.layer, b.part) for b in bufs] == \
        [(i, 2 * 16 * 128 * 4, 8, Component.FULL, i, PART) for i in range(2)]
    src = caches["model.layers.0.self_attn.attn"]
    layers[0].blocks[3].fill_(7)                  # the view is vLLM's memory
    assert (src[3].view(torch.uint8) == 7).all() and not (src[2].view(torch.uint8) == 7).all()


def test_two_sides_of_one_model_pair_and_another_block_size_does_not():
    a, b = buffers(describe(_cpu_caches())), buffers(describe(_cpu_caches(num_blocks=20)))
    assert layout_difference(a, b) is None          # capacity may differ
    c = buffers(describe(_cpu_caches(block=32)))
    assert "B/item" in layout_difference(a, c)


def test_block_outermost_layout_is_refused_by_name():
    whole = torch.zeros(8, 2, 2, 16, 128)           # [blocks, layers, heads, tokens, 2 x head]: BLHNC
    caches = {f"model.layers.{i}.self_attn.attn": whole[:, i] for i in range(2)}
    with pytest.raises(VllmLayoutError, match="BLHNC"):
        describe(caches)


def test_a_name_without_a_layer_index_is_refused():
    with pytest.raises(VllmLayoutError, match="no '.layers.N.'"):
        describe({"attn": torch.zeros(4, 1, 16, 128)})
