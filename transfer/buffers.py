"""Buffers as a transfer sees them: a region number and a size, never an address.

A side exposes its pool buffers (and its staging area) to a transport as numbered regions;
the peer names bytes as (region, offset) and the transport resolves them to wherever the
memory is mapped in its own process (a Mooncake session's remote address, a CUDA IPC
mapping, ...). So addresses never travel on the wire, and a transport that maps the peer's
memory at another address works unchanged.

    region:   0           1            2      ...   n-1          n
              full buf    swa buf      aux          (last pool)  staging area
    item i of a buffer = region r, bytes [i * item_bytes, (i + 1) * item_bytes)

`layout_difference` is the one check that two sides' buffers pair up (the registration and
the planner both use it).
"""

from collections.abc import Sequence

import msgspec

from kvpool.geometry import Component
from kvpool.storage import BufferDescriptor


class Buffer(msgspec.Struct, frozen=True, array_like=True):
    """One pool buffer, as both sides and the wire know it. Decoding validates it."""

    region: int  # index in the owner's exposed region table
    nbytes: int
    item_bytes: int
    component: Component
    layer: int | None  # None: a page-major buffer holding every layer of the component
    part: str | None  # "k", "v", "latent", ... for layer-major buffers

    def __post_init__(self) -> None:
        if self.region < 0 or self.nbytes <= 0 or self.item_bytes <= 0 or self.nbytes % self.item_bytes:
            raise ValueError(f"bad buffer (region {self.region}, {self.nbytes} B, {self.item_bytes} B/item)")

    @property
    def num_items(self) -> int:
        return self.nbytes // self.item_bytes


def buffers_of(descs: Sequence[BufferDescriptor]) -> list[Buffer]:
    """A pool's descriptors as Buffers, region i = descriptor i (the order a PoolEndpoint
    exposes them in)."""
    return [Buffer(i, d.nbytes, d.item_bytes, d.component, d.layer, d.part) for i, d in enumerate(descs)]


def by_component(bufs: Sequence[Buffer]) -> dict[Component, list[Buffer]]:
    out: dict[Component, list[Buffer]] = {}
    for b in bufs:
        out.setdefault(Component(b.component), []).append(b)
    return out


def _shape(b: Buffer) -> tuple:
    return (b.layer, b.part, b.item_bytes)


def component_difference(component: Component, ours: Sequence[Buffer], theirs: Sequence[Buffer]) -> str | None:
    """None if one component's buffers pair up one to one (same count; per position the same
    layer, part and item size), else the first difference."""
    c = Component(component).value
    if len(ours) != len(theirs):
        return (
            f"{c}: {len(ours)} source buffers vs {len(theirs)} destination buffers "
            "(page-major vs layer-major, or a different layer set)"
        )
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if _shape(a) != _shape(b):
            return (
                f"{c} buffer {i}: source (layer {a.layer}, {a.part}, {a.item_bytes} B/item) vs "
                f"destination (layer {b.layer}, {b.part}, {b.item_bytes} B/item)"
            )
    return None


def layout_difference(
    ours: Sequence[Buffer], theirs: Sequence[Buffer], paged: bool = True, per_request: bool = True
) -> str | None:
    """None if every component of the two sides pairs up, else the first difference. With
    paged=False the paged components are not compared buffer by buffer: pools of different
    page sizes pair them by token (transfer.tokens); with per_request=False neither are state
    slots and the AUX row (TP shards of different sizes: transfer.reshard). The component
    sets must still match."""
    a, b = by_component(ours), by_component(theirs)
    if set(a) != set(b):
        return (
            f"component sets differ: destination lacks {sorted(c.value for c in set(a) - set(b))}, "
            f"source lacks {sorted(c.value for c in set(b) - set(a))}"
        )
    for c in a:
        diff = component_difference(c, a[c], b[c]) if (per_request if c.per_request else paged) else None
        if diff:
            return diff
    return None
