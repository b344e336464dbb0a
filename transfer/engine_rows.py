r"""An engine's KV blocks (kvpool.engine: vLLM's tensors) as token-row lanes (transfer.tokens),
so engine pools of different block sizes and TP sizes pair by token: the planner's by-token
path (runs of rows, staged pieces, direct LaneRuns) and transfer.reshard's head slices apply
unchanged. A buffer's part says how a block holds its rows (kvpool.engine names it):

    part   one block of the buffer (P tokens, H heads of this rank, D bytes a head)   lanes
    "kv"   [H, K^T|V]    vLLM CPU: per head h (its 2*P*D bytes), K      per head h, each of
                         dim-major [D/e, P] (element i of every          K's D/e elements i:
                         token back to back), then V [P, D] a row a      offset h*2PD + i*P*e,
                         token: what its kernels (ISA vec, vec16)        row e; then V: offset
                         write, whatever the tensor's shape says         h*2PD + P*D, row D
    "k+v"  [2, P, H, D]  FlashInfer NHD: K's P rows, then V's              "k": offset 0, row H*D
                                                                           "v": offset P*H*D
    "k"    [P, H, D]     K/V-first (flash-attention), one buffer for K     one: offset 0, row H*D
    "v"    [P, H, D]     ... and one for V                                 (rows back to back)

(e: the dtype's bytes.) A head-outer lane ("kv") holds part of one head, so a TP reshard
pairs such lanes head by head (transfer.reshard), each head's in the same order on both
sides; a token-outer lane's row holds every head of the rank, so a TP slice is part of its
row, as for our own pools. What has no rows here: a page pool that attention and
Mamba/GDN state layers share (its items are pages of either, padded to the state's size), any
other part.
The lanes of a peer are derived from its claimed buffers and checked against the model at its
block size and TP size before any offset is taken from them.
"""

from kvpool.dtypes import itemsize
from kvpool.errors import SpecError
from kvpool.geometry import Component
from kvpool.shards import Part, held
from kvpool.spec import ModelSpec
from transfer.buffers import Buffer
from transfer.errors import LayoutIncompatible
from transfer.tokens import Lane

HEAD_OUTER, KV_BLOCK = "kv", "k+v"
TOKEN_OUTER = ("k", "v")


def engine_lanes(
    model: ModelSpec, page_size: int, tp_size: int, bufs: list[Buffer], side: str
) -> dict[Component, tuple[Lane, ...]]:
    """The lanes of a side whose engine pool holds `model`'s attention blocks of `page_size`
    tokens at TP size `tp_size` in `bufs` (the module docstring); LayoutIncompatible naming
    the first buffer that is not such a block."""
    attn = model.full
    if attn is None or not hasattr(attn, "kv_heads"):
        raise LayoutIncompatible(f"{model.name}: only attention (K/V) blocks are described as token rows")
    try:
        heads = held(Part(attn.kv_heads, 1), tp_size, 0, f"{model.name}: kv_heads")[1]
    except SpecError as exc:
        raise LayoutIncompatible(f"{side} TP size {tp_size}: {exc}") from None
    head = attn.k_dim * itemsize(attn.dtype)
    out = []
    for i, b in enumerate(bufs):
        if Component(b.component) is not Component.FULL or b.part not in (HEAD_OUTER, KV_BLOCK, *TOKEN_OUTER):
            raise LayoutIncompatible(
                f"{side} buffer {i} (layer {b.layer}, {b.part}): not attention blocks (a page pool that "
                "attention and Mamba/GDN state layers share has no token rows)"
            )
        width = 1 if b.part in TOKEN_OUTER else 2
        block = page_size * heads * head * width
        if b.item_bytes != block:
            raise LayoutIncompatible(
                f"{side} buffer {i} (layer {b.layer}, {b.part}): {b.item_bytes} B/item, a block of {page_size} "
                f"tokens x {heads} heads x {head * width} B is {block} B"
            )
        out += _lanes(i, b, page_size, heads, head, itemsize(attn.dtype))
    return {Component.FULL: tuple(out)} if out else {}


def _lanes(i: int, b: Buffer, page_size: int, heads: int, head: int, size: int) -> list[Lane]:
    def lane(part, offset, row, h=-1):
        return Lane(i, b.region, b.num_items, b.layer, part, offset, b.item_bytes, page_size, row, row, h)

    if b.part == HEAD_OUTER:  # head h: K's element d of every token (P of `size` B), ..., then V's P rows
        return [
            lane(HEAD_OUTER, h * page_size * 2 * head + offset, row, h)
            for h in range(heads)
            for offset, row in [(d * page_size * size, size) for d in range(head // size)] + [(page_size * head, head)]
        ]
    row = heads * head
    if b.part == KV_BLOCK:
        return [lane("k", 0, row), lane("v", page_size * row, row)]
    return [lane(b.part, 0, row)]
