"""EnginePool: KV memory a model engine owns (vLLM's KV cache tensors, ...), described as
disagg's layer-major buffers, so a transfer.endpoint.PoolEndpoint (KVSender, KVReceiver)
exposes and moves it unchanged. disagg allocates nothing here and frees nothing: the engine
keeps its tensors alive and decides which blocks a request holds; a transfer names them.

    engine tensor (one per attention layer)           EnginePool buffers (item = one block)
    [num_blocks, heads, block_size, 2 * head]          layer L, part "kv": block b = bytes of t[b]
      (vLLM CPU: per head K dim-major, then V)
    [num_blocks, 2, block_size, heads, head]           layer L, part "k+v": block b = bytes of t[b]
      (block-first, K then V inside a block)
    [2, num_blocks, block_size, heads, head]           layer L, part "k": block b = bytes of t[0, b]
      (K/V-first, as CUDA flash-attention keeps it)    layer L, part "v": block b = bytes of t[1, b]

Every buffer is a uint8 [num_blocks, block_bytes] view of the engine's memory, so the
planner's run grouping applies (consecutive blocks: one range per run and buffer) and two
engines of one model, block size and TP shard pair buffer by buffer
(transfer.buffers.layout_difference). The part names how a block holds its token rows, so
engines of different block sizes or TP sizes pair by token (transfer.engine_rows: per head of
"kv" a lane per K element and one for V, K and V lanes of "k+v", one of "k" or "v";
transfer.reshard splits heads). An engine's block 0 is the sentinel item (vLLM's null block
is block 0): a transfer never names it.

    views over a shared page pool (vLLM's hybrid   one buffer per distinct page region: block b
      KV cache: full and sliding-window blocks,     = page b, whatever layer group holds it
      Mamba/GDN conv+SSM states in the same pages)  (shared_pages)

A page region of full and sliding-window layers holds either group's blocks with the same
rows, so its lanes serve both components (FULL and SWA: attention_model names the window
layers): each group's blocks pair by token within the group, under that component's rules.
Where a Mamba/GDN state shares the pages and its geometry is described (attention_model's
`linear`: disagg.vllm.states), a region's page also holds a state slot's conv and temporal
rows (MAMBA, one row per page), which TP ranks of other sizes split as our own pools' states
(kvpool.shards); such a pool pairs another block size only at another TP size too
(`whole_states` says why: the state has no buffer of its own to move whole by).
What this surface does not describe: a state whose geometry is not known (a pool built with
`no_rows` pairs only its own block size and TP: a sender refuses others with
LayoutIncompatible naming both and why); layouts whose blocks of one layer are not back to back.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.errors import SpecError
from kvpool.geometry import Component
from kvpool.layout import Layout
from kvpool.shards import Shard
from kvpool.spec import AttentionSpec, LinearStateSpec, ModelSpec
from kvpool.storage import BufferDescriptor

COMPONENTS = (Component.FULL,)


@dataclass(frozen=True)
class EngineBuffer:
    """One engine-owned tensor of one layer as items: `blocks` is uint8 [num_blocks,
    block_bytes] over the engine's memory (block b of the layer = row b)."""

    layer: int
    part: str
    blocks: torch.Tensor


@dataclass(frozen=True)
class EnginePoolConfig:
    """What a PoolEndpoint and a KVSender read off a pool's config (HybridPool's PoolConfig
    has the same fields)."""

    model: ModelSpec
    page_size: int  # the engine's block size (tokens per block)
    device: torch.device
    tp_size: int = 1
    tp_rank: int = 0
    layout: Layout = Layout.LAYER_MAJOR
    components: tuple[Component, ...] = COMPONENTS

    @property
    def shard(self) -> Shard:
        """This pool's side of a transfer: page size and TP (size, rank), as PoolConfig.shard."""
        return Shard(self.page_size, self.tp_size, self.tp_rank, engine_blocks=True)


class EnginePool:
    """An engine's KV tensors as disagg pool buffers (module docstring). Same memory: what a
    receiver's transport writes lands in the engine's cache."""

    token_rows = False  # items are an engine's blocks, their rows named by part (transfer.engine_rows)

    def __init__(
        self, config: EnginePoolConfig, buffers: Sequence[EngineBuffer], *, no_rows: str = "", whole_states: str = ""
    ):
        self.config = config
        self.no_rows = no_rows  # why its blocks pair only whole ("": rows as its parts say)
        # why a peer of our TP size must have our block size too ("": any): a state that has no
        # buffer of its own moves whole pages, or TP slices of its row
        self.whole_states = whole_states
        self.page_size = config.page_size
        self.buffers = list(buffers)
        _check(config, self.buffers)
        self.num_blocks = self.buffers[0].blocks.shape[0]

    def buffer_descriptors(self) -> list[BufferDescriptor]:
        """Region i = buffer i (in layer order, then part), as both sides number them."""
        return [
            BufferDescriptor(b.blocks.data_ptr(), b.blocks.numel(), b.blocks.shape[1], Component.FULL, b.layer, b.part)
            for b in self.buffers
        ]

    def exposed_tensors(self) -> dict[Component, list[torch.Tensor]]:
        """uint8 [num_items, item_bytes] per buffer, for gather and scatter."""
        return {Component.FULL: [b.blocks for b in self.buffers]}

    def exposed_placements(self) -> dict[Component, list[tuple[int, int, int, int]]]:
        """(buffer, layer, offset, bytes) of each layer in an item: a whole item per buffer."""
        return {Component.FULL: [(i, b.layer, 0, b.blocks.shape[1]) for i, b in enumerate(self.buffers)]}


def _check(config: EnginePoolConfig, buffers: list[EngineBuffer]) -> None:
    """One line naming the first buffer that cannot be an item table of this pool."""
    if not buffers:
        raise SpecError("an engine pool needs at least one KV buffer")
    if config.page_size < 1:
        raise SpecError(f"block size {config.page_size} must be positive")
    num_blocks = buffers[0].blocks.shape[0] if buffers[0].blocks.dim() == 2 else None
    seen = set()
    for b in buffers:
        t, what = b.blocks, f"engine KV buffer (layer {b.layer}, {b.part})"
        if t.dtype != torch.uint8 or t.dim() != 2 or not t.is_contiguous():
            raise SpecError(f"{what}: {t.dtype} {tuple(t.shape)} is not a contiguous uint8 [blocks, bytes] view")
        if t.shape[0] != num_blocks or t.shape[0] < 2:
            raise SpecError(
                f"{what}: {t.shape[0]} blocks, the first buffer has {num_blocks} (at least 2: block 0 "
                f"is the null block)"
            )
        if t.device != torch.device(config.device):
            raise SpecError(f"{what}: on {t.device}, the pool is on {config.device}")
        if not 0 <= b.layer < config.model.num_layers or (b.layer, b.part) in seen:
            raise SpecError(f"{what}: layer outside [0, {config.model.num_layers}) or given twice")
        seen.add((b.layer, b.part))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def block_first(layer: int, t: torch.Tensor) -> list[EngineBuffer]:
    """A layer's tensor whose dim 0 is the block ([num_blocks, ...], each block's bytes back to
    back: vLLM's CPU layout, block-first K/V layouts): one buffer, part block_part(t)."""
    _contiguous(layer, t)
    return [EngineBuffer(layer, block_part(t), t.view(torch.uint8).view(t.shape[0], -1))]


def block_part(t: torch.Tensor) -> str:
    """How a block-first tensor's block holds its token rows: "k+v" for [blocks, 2, block_size,
    heads, head] (K's rows, then V's: FlashInfer), else "kv" ([blocks, heads, block_size, 2 *
    head]: vLLM's CPU layout, whose kernels keep a head's K dim-major, then its V a row a
    token: transfer.engine_rows)."""
    return "k+v" if t.dim() == 5 and t.shape[1] == 2 else "kv"


def shared_pages(tensors: Sequence[tuple[int, str, torch.Tensor]]) -> list[EngineBuffer]:
    """(layer, part, tensor) of an engine whose tensors are views over pages, dim 0 the block:
    block b of a layer lies inside page b of a region (start, page bytes) of a storage that
    layers of other groups may share (vLLM's hybrid KV cache: one page pool holds attention
    blocks and Mamba/GDN conv+SSM states; a block id belongs to one group at a time). One
    buffer per distinct region, labelled by its first (layer, part), an item per whole page
    (a state's padding moves with it). Raises SpecError for a block that spills over its page
    or pages that overlap another region's (block-outermost layouts such as BLHNC). A region
    that holds attention blocks is labelled by its first attention layer (its part says where
    the blocks' rows lie: transfer.engine_rows), one of states only by its first state layer."""
    regions: dict[tuple[int, int, int], tuple[int, str, torch.Tensor]] = {}
    for layer, part, t in sorted(tensors, key=lambda x: (x[1] == "state", x[0], x[1])):  # attention labels first
        key = _region(layer, t)
        if key not in regions:
            regions[key] = (layer, part, t)
    spans = sorted((ptr, ptr + n * page, regions[(ptr, page, n)][0]) for ptr, page, n in regions)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            raise SpecError(
                f"layers {a} and {b}: their pages overlap (a block-outermost layout such as BLHNC: a "
                "layer's blocks are not back to back)"
            )
    out = []
    for (ptr, page, n), (layer, part, t) in regions.items():
        storage = t.untyped_storage()
        raw = torch.empty(0, dtype=torch.uint8, device=t.device)
        raw.set_(storage, ptr - storage.data_ptr(), (n, page), (page, 1))
        out.append(EngineBuffer(layer, part, raw))
    return out


def _region(layer: int, t: torch.Tensor) -> tuple[int, int, int]:
    """(first byte's address, page bytes, blocks) of a layer's block-major view."""
    size = t.element_size()
    page, n = t.stride(0) * size, t.shape[0]
    block = (1 + sum((d - 1) * s for d, s in zip(t.shape[1:], t.stride()[1:]))) * size
    if min(t.stride()) < 0 or page < block or n < 2:
        raise SpecError(
            f"layer {layer}: shape {tuple(t.shape)} strides {t.stride()}: a block of {block} B does not "
            f"fit its page of {page} B (its blocks are not back to back)"
        )
    storage = t.untyped_storage()
    start = t.data_ptr()
    if start + n * page > storage.data_ptr() + storage.nbytes():
        raise SpecError(
            f"layer {layer}: {n} pages of {page} B run past its storage (a block-outermost layout such "
            "as BLHNC: a layer's blocks are not back to back)"
        )
    return start, page, n


def kv_first(layer: int, t: torch.Tensor) -> list[EngineBuffer]:
    """A layer's tensor [2, num_blocks, ...] (K then V, each block-first: CUDA flash-attention's
    layout): two buffers, parts "k" and "v"."""
    _contiguous(layer, t)
    if t.shape[0] != 2:
        raise SpecError(f"layer {layer}: shape {tuple(t.shape)} is not [2, num_blocks, ...] (K then V)")
    raw = t.view(torch.uint8).view(2, t.shape[1], -1)
    return [EngineBuffer(layer, "k", raw[0]), EngineBuffer(layer, "v", raw[1])]


def _contiguous(layer: int, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise SpecError(
            f"layer {layer}: shape {tuple(t.shape)} strides {t.stride()} is not contiguous (its blocks "
            "are not back to back)"
        )


def attention_model(
    name: str,
    layers: Sequence[int],
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    num_layers: int | None = None,
    *,
    window_layers: Sequence[int] = (),
    window: int = 0,
    linear: LinearStateSpec | None = None,
) -> ModelSpec:
    """The ModelSpec of an engine's attention layers (what a LayoutInfo describes to the peer,
    and a refusal names): `window_layers` of `layers` are sliding-window ones (`window` tokens:
    the engine's longest), the rest full attention; `linear`: its state layers' geometry (a
    Mamba/GDN state in the same pages); `kv_heads` is the whole model's (before the TP split)."""
    layers, windowed = tuple(sorted(layers)), tuple(sorted(set(window_layers)))
    full = tuple(i for i in layers if i not in windowed)

    def spec(group, w=None):
        return AttentionSpec(group, kv_heads, head_dim, head_dim, dtype_name(dtype), w) if group else None

    return ModelSpec(
        name,
        num_layers or layers[-1] + 1,
        full=spec(full),
        swa=spec(windowed, window) if windowed else None,
        linear=linear,
    )
