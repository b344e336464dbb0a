"""From a ModelSpec to the byte segments one TP shard stores per page (or per request slot).

A segment is one (layer, part) tensor of one item: e.g. layer 3's K for one page is
[page_size, kv_heads / tp, k_dim] bf16. Each component's spec (kvpool.components) says what
its segments are; the layout module packs segments into buffers; kvpool.shards says which
heads (or channel groups) of the whole model a rank's row holds.
"""

from kvpool.components import SPECS, Component, Items, Segment
from kvpool.shards import Part
from kvpool.spec import ModelSpec

__all__ = [
    "Component",
    "Items",
    "Segment",
    "bytes_per_request",
    "bytes_per_token",
    "components",
    "item_bytes",
    "layer_group",
    "parts",
    "segments",
]


def layer_group(model: ModelSpec, component: Component):
    """The model's layer group a component stores (None for the AUX row, or if absent)."""
    return SPECS[component].group(model)


def components(model: ModelSpec) -> tuple[Component, ...]:
    """The components a pool of `model` holds, in Component order (AUX always)."""
    return tuple(c for c, spec in SPECS.items() if spec.present(model))


def parts(model: ModelSpec, component: Component, part: str) -> tuple[Part, ...]:
    """How one row of segment `part` of `component` splits across TP ranks (kvpool.shards):
    per token for paged components, per slot for state; the whole model's, before any split."""
    return SPECS[component].parts(model, part)


def segments(model: ModelSpec, component: Component, page_size: int, tp_size: int = 1) -> list[Segment]:
    """Segments of one item of `component` on one of `tp_size` shards (kvpool.shards: heads
    split, or replicated where TP exceeds them; MLA, NSA and the AUX row whole)."""
    return SPECS[component].segments(model, page_size, tp_size)


def item_bytes(model: ModelSpec, component: Component, page_size: int, tp_size: int = 1) -> int:
    """Payload bytes of one item (page or slot), without layout padding."""
    return sum(s.nbytes for s in segments(model, component, page_size, tp_size))


def bytes_per_token(model: ModelSpec, component: Component, tp_size: int = 1) -> int:
    assert not component.per_request
    return item_bytes(model, component, 1, tp_size)


def bytes_per_request(model: ModelSpec, component: Component, tp_size: int = 1) -> int:
    assert component.per_request
    return item_bytes(model, component, 1, tp_size)
