"""From a ModelSpec to the byte segments one TP shard stores per page (or per request slot).

A segment is one (layer, part) tensor of one item: e.g. layer 3's K for one page is
[page_size, kv_heads / tp, k_dim] bf16. The layout module packs segments into buffers;
kvpool.shards says which heads (or channel groups) of the whole model a rank's row holds.
"""

import math
from dataclasses import dataclass
from enum import Enum

from kvpool.aux_record import AUX_ROW_BYTES
from kvpool.dtypes import itemsize
from kvpool.errors import SpecError
from kvpool.shards import Part, held
from kvpool.spec import AttentionSpec, MLASpec, ModelSpec


class Component(str, Enum):
    FULL = "full"    # indexed by full page
    SWA = "swa"      # indexed by SWA page (translated from full pages)
    NSA = "nsa"      # indexed by full page
    MAMBA = "mamba"  # indexed by request state slot
    AUX = "aux"      # indexed by request aux row

    @property
    def per_request(self) -> bool:
        """Indexed by a per-request slot (one item per request), not by page."""
        return self in (Component.MAMBA, Component.AUX)

    @property
    def metadata(self) -> bool:
        """disagg's own record of the request (the AUX row), not model KV or state."""
        return self is Component.AUX

    # ---- transfer rules: the planner asks the component, never lists components itself ----
    @property
    def truncatable(self) -> bool:
        """The two sides' index arrays may differ in length (a window kept on one side, all
        pages on the other): the transfer truncates to the shorter. Others must match."""
        return self in (Component.SWA, Component.NSA)

    @property
    def windowed(self) -> bool:
        """Its index array covers only the request's last pages (the window's), not every page
        from the first: an item's page is counted from the end."""
        return self is Component.SWA

    @property
    def sent_last(self) -> bool:
        """Written after everything else has landed: its arrival marks the request complete."""
        return self is Component.AUX


@dataclass(frozen=True)
class Segment:
    layer: int                 # model layer index; -1 for AUX
    part: str                  # "k", "v", "latent", "key", "scale", "conv", "temporal", "row"
    shape: tuple[int, ...]     # per item (page or slot)
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def layer_group(model: ModelSpec, component: Component):
    """The model's layer group a component stores (None for the AUX row, or if absent)."""
    return {Component.FULL: model.full, Component.SWA: model.swa, Component.NSA: model.nsa,
            Component.MAMBA: model.linear}.get(component)


def components(model: ModelSpec) -> tuple[Component, ...]:
    """The components a pool of `model` holds, in Component order (AUX always)."""
    return tuple(c for c in Component if c.metadata or layer_group(model, c))


def parts(model: ModelSpec, component: Component, part: str) -> tuple[Part, ...]:
    """How one row of segment `part` of `component` splits across TP ranks (kvpool.shards):
    per token for paged components, per slot for state; the whole model's, before any split."""
    if component is Component.FULL and isinstance(model.full, MLASpec):
        return (Part(1, model.full.latent_dim * itemsize(model.full.dtype)),)
    if component in (Component.FULL, Component.SWA):
        attn = model.full if component is Component.FULL else model.swa
        if not isinstance(attn, AttentionSpec):
            raise SpecError(f"{model.name} has no {component.value} layers")
        return (Part(attn.kv_heads, (attn.k_dim if part == "k" else attn.v_dim) * itemsize(attn.dtype)),)
    if component is Component.NSA:
        nsa = model.nsa
        if nsa is None:
            raise SpecError(f"{model.name} has no nsa indexer")
        if part == "key":
            return (Part(1, nsa.key_dim * itemsize(nsa.key_dtype)),)
        return (Part(1, nsa.key_dim // nsa.scale_block * itemsize(nsa.scale_dtype)),)
    if component is Component.MAMBA:
        lin = model.linear
        if lin is None:
            raise SpecError(f"{model.name} has no linear-state layers")
        if part == "conv":
            return tuple(Part(u, ch * lin.conv_width * itemsize(lin.conv_dtype)) for u, ch in lin.conv_layout)
        return (Part(lin.temporal_heads, lin.temporal_d1 * lin.temporal_d2 * itemsize(lin.temporal_dtype)),)
    if component is Component.AUX:
        return (Part(1, AUX_ROW_BYTES),)
    raise SpecError(f"unknown component {component!r}")


def _held(model: ModelSpec, what: str, units: int, tp_size: int) -> int:
    """Units of a part one of `tp_size` ranks holds (kvpool.shards.held), refusal in words."""
    return held(Part(units, 1), tp_size, 0, f"{model.name}: {what}")[1]


def segments(model: ModelSpec, component: Component, page_size: int, tp_size: int = 1) -> list[Segment]:
    """Segments of one item of `component` on one of `tp_size` shards (kvpool.shards: heads
    split, or replicated where TP exceeds them; MLA, NSA and the AUX row whole)."""
    if component is Component.FULL and isinstance(model.full, MLASpec):
        mla = model.full
        return [Segment(l, "latent", (page_size, mla.latent_dim), mla.dtype) for l in mla.layers]
    if component in (Component.FULL, Component.SWA):
        attn = model.full if component is Component.FULL else model.swa
        if not isinstance(attn, AttentionSpec):
            raise SpecError(f"{model.name} has no {component.value} layers")
        heads = _held(model, f"{component.value} kv_heads", attn.kv_heads, tp_size)
        out = []
        for l in attn.layers:
            out.append(Segment(l, "k", (page_size, heads, attn.k_dim), attn.dtype))
            out.append(Segment(l, "v", (page_size, heads, attn.v_dim), attn.dtype))
        return out
    if component is Component.NSA:
        nsa = model.nsa
        if nsa is None:
            raise SpecError(f"{model.name} has no nsa indexer")
        scales = nsa.key_dim // nsa.scale_block
        out = []
        for l in nsa.layers:
            out.append(Segment(l, "key", (page_size, nsa.key_dim), nsa.key_dtype))
            out.append(Segment(l, "scale", (page_size, scales), nsa.scale_dtype))
        return out
    if component is Component.MAMBA:
        lin = model.linear
        if lin is None:
            raise SpecError(f"{model.name} has no linear-state layers")
        if tp_size > 1 and lin.tp_refusal:
            raise SpecError(f"{model.name}: TP {tp_size} refused for its linear-state layers: {lin.tp_refusal}")
        conv_dim = sum(_held(model, "conv groups", u, tp_size) * ch for u, ch in lin.conv_layout)
        heads = _held(model, "temporal heads", lin.temporal_heads, tp_size)
        out = []
        for l in lin.layers:
            out.append(Segment(l, "conv", (conv_dim, lin.conv_width), lin.conv_dtype))
            out.append(Segment(l, "temporal", (heads, lin.temporal_d1, lin.temporal_d2), lin.temporal_dtype))
        return out
    if component is Component.AUX:
        return [Segment(-1, "row", (AUX_ROW_BYTES,), "uint8")]
    raise SpecError(f"unknown component {component!r}")


def item_bytes(model: ModelSpec, component: Component, page_size: int, tp_size: int = 1) -> int:
    """Payload bytes of one item (page or slot), without layout padding."""
    return sum(s.nbytes for s in segments(model, component, page_size, tp_size))


def bytes_per_token(model: ModelSpec, component: Component, tp_size: int = 1) -> int:
    assert not component.per_request
    return item_bytes(model, component, 1, tp_size)


def bytes_per_request(model: ModelSpec, component: Component, tp_size: int = 1) -> int:
    assert component.per_request
    return item_bytes(model, component, 1, tp_size)
