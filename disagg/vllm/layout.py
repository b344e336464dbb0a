"""vLLM's KV tensors as disagg buffers: what register_kv_caches hands a worker, described in
transfer's terms (transfer.buffers.Buffer: region, bytes, bytes per item, component, layer, part).

vLLM's CPU attention backend (KV cache layout LBHNC) gives one tensor per attention layer,
[num_blocks, num_kv_heads, block_size, 2 * head_size]: block b of a layer is one contiguous
run of bytes, K and V of each head and token side by side. That is a layer-major buffer whose
item is a block (vLLM's block 0 is its null block, as item 0 is our sentinel), so whole
blocks move as one range per (block run, layer), the planner's run grouping applies, and two
sides of the same model, block size and TP pair buffer by buffer (transfer.buffers'
layout_difference). Tokens inside a block are not rows of one stride here (heads outermost),
so pools of different block sizes or TP sizes cannot pair by token yet: refused.

Layouts whose blocks of one layer are not back to back (BLHNC and the other block-outermost
layouts of some CUDA backends: a layer's block b is a strided slice of a buffer of every layer)
are refused by name until the transfer layer takes a pitch other than the item's size.
"""

import re
from dataclasses import dataclass

import torch

from kvpool.geometry import Component
from transfer.buffers import Buffer

PART = "kv"   # one buffer per layer, K and V interleaved inside a block (not kvpool's k / v parts)
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class VllmLayoutError(ValueError):
    """KV tensors this connector cannot describe yet; the message names the layer and why."""


@dataclass(frozen=True)
class LayerBuffer:
    name: str              # vLLM's layer name (model.layers.3.self_attn.attn)
    layer: int             # the model layer index read off the name
    blocks: torch.Tensor   # uint8 [num_blocks, block_bytes] view of vLLM's tensor (same memory)


def layer_index(name: str) -> int:
    m = _LAYER.search(name)
    if m is None:
        raise VllmLayoutError(f"KV cache layer {name!r}: no '.layers.N.' in its name")
    return int(m.group(1))


def describe(kv_caches: dict[str, torch.Tensor]) -> list[LayerBuffer]:
    """Each layer's tensor as blocks of bytes, in layer order (so both sides number their
    regions alike). Raises VllmLayoutError for a tensor whose blocks are not back to back."""
    out = []
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise VllmLayoutError(f"KV cache layer {name!r}: {type(t).__name__} is not a per-layer block tensor "
                                  "(Mamba/GDN state lists and block-outermost layouts are not described yet)")
        if not t.is_contiguous():
            raise VllmLayoutError(f"KV cache layer {name!r}: shape {tuple(t.shape)} strides {t.stride()} is not "
                                  "contiguous (a block-outermost layout such as BLHNC; use a layer-compact one, "
                                  "VLLM_KV_CACHE_LAYOUT=LBHNC or LBNHC)")
        blocks = t.view(torch.uint8).view(t.shape[0], -1)
        out.append(LayerBuffer(name, layer_index(name), blocks))
    out.sort(key=lambda b: b.layer)
    if len({b.layer for b in out}) != len(out):
        raise VllmLayoutError(f"two KV cache tensors for one layer: {[b.name for b in out]}")
    return out


def buffers(layers: list[LayerBuffer], first_region: int = 0) -> list[Buffer]:
    """The layers as transfer Buffers, region first_region + i = layer i of `layers`."""
    return [Buffer(first_region + i, b.blocks.numel(), b.blocks.shape[1], Component.FULL, b.layer, PART)
            for i, b in enumerate(layers)]
