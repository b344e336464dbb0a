"""A pool component is one object: everything about it in one spec class, found through SPECS.

    Component.SWA  ->  SPECS[Component.SWA]: SWASpec
        items         what indexes its items (full pages, SWA pages, request slots)
        group         the model's layer group it stores
        parts         how one row splits across TP ranks (kvpool.shards)
        segments      the (layer, part) tensors of one item on one TP shard
        token items   where a token's KV lives in it (paged components)
        first kept    the first position a receiver holds (SWA: the window)
        describe      what `disagg presets` prints beside its bytes
        rules         per_request, metadata, truncatable, windowed, sent_last (the planner asks these)

Adding a component is its name in Component, one ComponentSpec subclass and one SPECS
entry, and the pool class that keeps its items in kvpool.pools.hybrid.POOL_CLASSES (the
spec knows nothing of pools: they are built on it, as vLLM's spec_manager_map maps a KV
cache spec to its manager). The pool config, HybridPool, kvpool.positions, the planner and
`disagg presets` dispatch through the maps and never list components themselves. This
module imports no torch: a spec, a preset or a `--help` needs only names and sizes.
"""

import math
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import numpy as np

from kvpool.aux_record import AUX_ROW_BYTES
from kvpool.dtypes import itemsize
from kvpool.errors import SpecError
from kvpool.shards import Part, held
from kvpool.spec import AttentionSpec, LinearStateSpec, MLASpec, ModelSpec


class Component(str, Enum):
    """A component's name (its wire and buffer identity); what it is: `spec`."""

    FULL = "full"
    SWA = "swa"
    NSA = "nsa"
    MAMBA = "mamba"
    AUX = "aux"

    @property
    def spec(self) -> "ComponentSpec":
        return SPECS[self]

    @property
    def per_request(self) -> bool:
        """Indexed by a per-request slot (one item per request), not by page."""
        return SPECS[self].items is Items.REQUEST_SLOTS

    @property
    def metadata(self) -> bool:
        """disagg's own record of the request (the AUX row), not model KV or state."""
        return SPECS[self].metadata

    @property
    def truncatable(self) -> bool:
        """The two sides' index arrays may differ in length (a window kept on one side, all
        pages on the other): the transfer truncates to the shorter. Others must match."""
        return SPECS[self].truncatable

    @property
    def windowed(self) -> bool:
        """Its index array covers only the request's last pages (the window's), not every page
        from the first: an item's page is counted from the end."""
        return SPECS[self].windowed

    @property
    def sent_last(self) -> bool:
        """Written after everything else has landed: its arrival marks the request complete."""
        return SPECS[self].sent_last


class Items(Enum):
    """What indexes a component's items: the pool sizes and allocators are per kind of item."""

    FULL_PAGES = "full pages"  # the request's pages
    SWA_PAGES = "swa pages"  # SWA pages, translated from the request's full pages
    REQUEST_SLOTS = "request slots"  # one item per request


@dataclass(frozen=True)
class Segment:
    layer: int  # model layer index; -1 for AUX
    part: str  # "k", "v", "latent", "key", "scale", "conv", "temporal", "row"
    shape: tuple[int, ...]  # per item (page or slot)
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def _held(model: ModelSpec, what: str, units: int, tp_size: int) -> int:
    """Units of a part one of `tp_size` ranks holds (kvpool.shards.held), refusal in words."""
    return held(Part(units, 1), tp_size, 0, f"{model.name}: {what}")[1]


class ComponentSpec:
    """What one component is; a subclass per component, one instance in SPECS."""

    component: ClassVar[Component]
    items: ClassVar[Items]
    metadata: ClassVar[bool] = False
    truncatable: ClassVar[bool] = False
    windowed: ClassVar[bool] = False
    sent_last: ClassVar[bool] = False

    def group(self, model: ModelSpec):
        """The model's layer group this component stores (None: the model has none)."""
        raise NotImplementedError

    def present(self, model: ModelSpec) -> bool:
        """Whether a pool of `model` holds this component."""
        return self.group(model) is not None

    def _group(self, model: ModelSpec):
        group = self.group(model)
        if group is None:
            raise SpecError(f"{model.name} has no {self.component.value} layers")
        return group

    def parts(self, model: ModelSpec, part: str) -> tuple[Part, ...]:
        """How one row of segment `part` splits across TP ranks (kvpool.shards): per token for
        paged components, per slot for state; the whole model's, before any split."""
        raise NotImplementedError

    def segments(self, model: ModelSpec, page_size: int, tp_size: int) -> list[Segment]:
        """Segments of one item on one of `tp_size` shards."""
        raise NotImplementedError

    def page_items(self, pool, pages: np.ndarray) -> np.ndarray:
        """The items of a paged component that back the request's full pages `pages`."""
        return pages

    def first_kept(self, model: ModelSpec, num_tokens: int) -> int:
        """The first position of a request of `num_tokens` whose KV a receiver holds."""
        return 0

    def describe(self, model: ModelSpec) -> dict:
        """What `disagg presets` lists beside the component's bytes."""
        return {}


def _attention_parts(attn: AttentionSpec, part: str) -> tuple[Part, ...]:
    return (Part(attn.kv_heads, (attn.k_dim if part == "k" else attn.v_dim) * itemsize(attn.dtype)),)


def _attention_segments(
    model: ModelSpec, what: str, attn: AttentionSpec, page_size: int, tp_size: int
) -> list[Segment]:
    heads = _held(model, f"{what} kv_heads", attn.kv_heads, tp_size)
    return [
        Segment(l, p, (page_size, heads, attn.k_dim if p == "k" else attn.v_dim), attn.dtype)
        for l in attn.layers
        for p in ("k", "v")
    ]


class FullSpec(ComponentSpec):
    """Full-attention layers: MHA/GQA K and V (heads split by TP) or the MLA latent (whole on
    every rank), per full page."""

    component = Component.FULL
    items = Items.FULL_PAGES

    def group(self, model: ModelSpec):
        return model.full

    def parts(self, model: ModelSpec, part: str) -> tuple[Part, ...]:
        full = self._group(model)
        if isinstance(full, MLASpec):
            return (Part(1, full.latent_dim * itemsize(full.dtype)),)
        return _attention_parts(full, part)

    def segments(self, model: ModelSpec, page_size: int, tp_size: int) -> list[Segment]:
        full = self._group(model)
        if isinstance(full, MLASpec):
            return [Segment(l, "latent", (page_size, full.latent_dim), full.dtype) for l in full.layers]
        return _attention_segments(model, "full", full, page_size, tp_size)

    def describe(self, model: ModelSpec) -> dict:
        return {"attention": "mla" if isinstance(model.full, MLASpec) else "mha"}


class SWASpec(ComponentSpec):
    """Sliding-window layers: K and V in their own, smaller page pool; only the window moves."""

    component = Component.SWA
    items = Items.SWA_PAGES
    truncatable = True
    windowed = True

    def group(self, model: ModelSpec):
        return model.swa

    def parts(self, model: ModelSpec, part: str) -> tuple[Part, ...]:
        return _attention_parts(self._group(model), part)

    def segments(self, model: ModelSpec, page_size: int, tp_size: int) -> list[Segment]:
        return _attention_segments(model, "swa", self._group(model), page_size, tp_size)

    def page_items(self, pool, pages: np.ndarray) -> np.ndarray:
        return pool.swa_allocator.translate(pages)  # SENTINEL once a page left the window

    def first_kept(self, model: ModelSpec, num_tokens: int) -> int:
        return max(0, num_tokens - model.swa.window)  # every page size's window pages cover these

    def describe(self, model: ModelSpec) -> dict:
        return {"window": model.swa.window}


class NSASpec(ComponentSpec):
    """The NSA indexer's quantized keys and their scales, on the full pages (whole on every rank)."""

    component = Component.NSA
    items = Items.FULL_PAGES
    truncatable = True

    def group(self, model: ModelSpec):
        return model.nsa

    def parts(self, model: ModelSpec, part: str) -> tuple[Part, ...]:
        nsa = self._group(model)
        if part == "key":
            return (Part(1, nsa.key_dim * itemsize(nsa.key_dtype)),)
        return (Part(1, nsa.key_dim // nsa.scale_block * itemsize(nsa.scale_dtype)),)

    def segments(self, model: ModelSpec, page_size: int, tp_size: int) -> list[Segment]:
        nsa = self._group(model)
        scales = nsa.key_dim // nsa.scale_block
        return [
            seg
            for l in nsa.layers
            for seg in (
                Segment(l, "key", (page_size, nsa.key_dim), nsa.key_dtype),
                Segment(l, "scale", (page_size, scales), nsa.scale_dtype),
            )
        ]


class MambaSpec(ComponentSpec):
    """Linear-attention (Mamba2 / GDN) layers: conv and temporal state, one slot per request;
    heads and conv channel groups split by TP (a transposed conv state: in each column)."""

    component = Component.MAMBA
    items = Items.REQUEST_SLOTS

    def group(self, model: ModelSpec):
        return model.linear

    def parts(self, model: ModelSpec, part: str) -> tuple[Part, ...]:
        lin: LinearStateSpec = self._group(model)
        if part == "conv":
            size = itemsize(lin.conv_dtype)
            if lin.conv_transposed:  # [width, channels]: each column's channel groups, column by column
                return tuple(Part(u, ch * size) for u, ch in lin.conv_layout) * lin.conv_width
            return tuple(Part(u, ch * lin.conv_width * size) for u, ch in lin.conv_layout)
        return (Part(lin.temporal_heads, lin.temporal_d1 * lin.temporal_d2 * itemsize(lin.temporal_dtype)),)

    def segments(self, model: ModelSpec, page_size: int, tp_size: int) -> list[Segment]:
        lin: LinearStateSpec = self._group(model)
        if tp_size > 1 and lin.tp_refusal:
            raise SpecError(f"{model.name}: TP {tp_size} refused for its linear-state layers: {lin.tp_refusal}")
        conv_dim = sum(_held(model, "conv groups", u, tp_size) * ch for u, ch in lin.conv_layout)
        heads = _held(model, "temporal heads", lin.temporal_heads, tp_size)
        return [
            seg
            for l in lin.layers
            for seg in (
                Segment(
                    l,
                    "conv",
                    (lin.conv_width, conv_dim) if lin.conv_transposed else (conv_dim, lin.conv_width),
                    lin.conv_dtype,
                ),
                Segment(l, "temporal", (heads, lin.temporal_d1, lin.temporal_d2), lin.temporal_dtype),
            )
        ]

    def describe(self, model: ModelSpec) -> dict:
        return {
            f"{part}_bytes_per_request": sum(s.nbytes for s in self.segments(model, 1, 1) if s.part == part)
            for part in ("conv", "temporal")
        }


class AuxSpec(ComponentSpec):
    """disagg's own record of a request (kvpool.aux_record), one row per request, sent last:
    its arrival means the request's KV has landed. Every pool holds it."""

    component = Component.AUX
    items = Items.REQUEST_SLOTS
    metadata = True
    sent_last = True

    def group(self, model: ModelSpec):
        return None

    def present(self, model: ModelSpec) -> bool:
        return True

    def parts(self, model: ModelSpec, part: str) -> tuple[Part, ...]:
        return (Part(1, AUX_ROW_BYTES),)

    def segments(self, model: ModelSpec, page_size: int, tp_size: int) -> list[Segment]:
        return [Segment(-1, "row", (AUX_ROW_BYTES,), "uint8")]


SPECS: dict[Component, ComponentSpec] = {
    spec.component: spec for spec in (FullSpec(), SWASpec(), NSASpec(), MambaSpec(), AuxSpec())
}
assert list(SPECS) == list(Component), "one spec per component, in Component order"
