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
row, as for our own pools. A model of full and sliding-window layers (vLLM's KV
cache groups over one page pool: a block is one group's at a time) has the same lanes under
FULL and SWA, so the planner pairs a window group's blocks by SWA's rule (the positions both
sides hold) and a full group's by FULL's. A page pool that Mamba/GDN state layers share with
attention (vLLM's hybrid KV cache: a page is a block of attention or a state slot, padded to
the larger) has, where the model describes the state (model.linear), MAMBA lanes too: each
region's conv state at offset 0 and temporal state after it, one row per page, so a state
slot pairs row for row and TP slices of it follow kvpool.shards' parts (a transposed conv
state: per column). What has no rows here: such a pool whose state is not described, any
other part.
The lanes of a peer are derived from its claimed buffers and checked against the model at its
block size and TP size before any offset is taken from them.
"""

from kvpool.dtypes import itemsize
from kvpool.errors import SpecError
from kvpool.geometry import Component, segments
from kvpool.shards import Part, held
from kvpool.spec import ModelSpec
from transfer.buffers import Buffer
from transfer.errors import LayoutIncompatible
from transfer.tokens import Lane

HEAD_OUTER, KV_BLOCK = "kv", "k+v"
TOKEN_OUTER = ("k", "v")
BLOCK_PARTS = (HEAD_OUTER, KV_BLOCK, *TOKEN_OUTER)
STATE = "state"  # a region of Mamba/GDN states only (kvpool.engine.shared_pages)


def engine_lanes(
    model: ModelSpec, page_size: int, tp_size: int, bufs: list[Buffer], side: str
) -> dict[Component, tuple[Lane, ...]]:
    """The lanes of a side whose engine pool holds `model`'s attention blocks of `page_size`
    tokens at TP size `tp_size` in `bufs` (the module docstring), under each attention
    component the model has (FULL, SWA: the same lanes, a page region holding blocks of
    either group) and, where a Mamba/GDN state shares the pages (model.linear), MAMBA: each
    region's conv and temporal state rows; LayoutIncompatible naming the first buffer that is
    not such a page."""
    attn = _attention(model)
    try:
        heads = held(Part(attn.kv_heads, 1), tp_size, 0, f"{model.name}: kv_heads")[1]
        state = _state_bytes(model, tp_size)
    except SpecError as exc:
        raise LayoutIncompatible(f"{side} TP size {tp_size}: {exc}") from None
    head = attn.k_dim * itemsize(attn.dtype)
    rows, states, parts = [], [], BLOCK_PARTS + ((STATE,) if state else ())
    for i, b in enumerate(bufs):
        what = f"{side} buffer {i} (layer {b.layer}, {b.part})"
        if Component(b.component) is not Component.FULL or b.part not in parts:
            raise LayoutIncompatible(
                f"{what}: not attention blocks (a page pool that attention and Mamba/GDN state layers share "
                "has no token rows unless its state is described)"
            )
        if state:
            if b.item_bytes < sum(state):
                raise LayoutIncompatible(f"{what}: {b.item_bytes} B/item, a state of {sum(state)} B")
            states += _state_lanes(i, b, *state)
        if b.part == STATE:
            continue  # a region of states only
        width = 1 if b.part in TOKEN_OUTER else 2
        block = page_size * heads * head * width
        if b.item_bytes != block and not (state and b.item_bytes > block):  # pages padded to a state's
            raise LayoutIncompatible(
                f"{what}: {b.item_bytes} B/item, a block of {page_size} tokens x {heads} heads x {head * width} B "
                f"is {block} B"
            )
        rows += _lanes(i, b, page_size, heads, head, itemsize(attn.dtype))
    out = {c: tuple(rows) for c, g in ((Component.FULL, model.full), (Component.SWA, model.swa)) if g and rows}
    return out | ({Component.MAMBA: tuple(states)} if states else {})


def _state_bytes(model: ModelSpec, tp_size: int) -> tuple[int, int] | None:
    """(conv, temporal) bytes of one layer's state on a rank of `tp_size` (None: no state)."""
    if model.linear is None:
        return None
    segs = segments(model, Component.MAMBA, 1, tp_size)[:2]
    return segs[0].nbytes, segs[1].nbytes


def _state_lanes(i: int, b: Buffer, conv: int, temporal: int) -> list[Lane]:
    """A region's state rows: an item is one slot's page, the conv state first, then the
    temporal state (disagg.vllm.states), padding after."""
    return [
        Lane(i, b.region, b.num_items, b.layer, part, offset, b.item_bytes, 1, n, n)
        for part, offset, n in (("conv", 0, conv), ("temporal", conv, temporal))
    ]


def _attention(model: ModelSpec):
    """The geometry every attention layer of an engine shares (full and sliding-window layers
    alike: their blocks share pages); LayoutIncompatible if there is none or they differ."""
    groups = [g for g in (model.full, model.swa) if g is not None]
    if not groups or not all(hasattr(g, "kv_heads") for g in groups):
        raise LayoutIncompatible(f"{model.name}: only attention (K/V) blocks are described as token rows")
    shapes = {(g.kv_heads, g.k_dim, g.v_dim, g.dtype) for g in groups}
    if len(shapes) > 1:
        raise LayoutIncompatible(f"{model.name}: full and sliding-window layers of different shapes {sorted(shapes)}")
    return groups[0]


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
