"""A side's buffers as the planner reads them on every send, worked out once per buffer tuple.

A sender plans every request against the same two buffer tuples (its endpoint's, and the
peer's from its registration: KVSender, RemotePool): grouping them by component, pairing
one side's with the other's (transfer.buffers' check) and each component's regions, item
sizes and item count as arrays depend on nothing else. Planning a 2k-token send of a
layer-major pool repeated that per send (72 buffers paired one by one); here it is looked up
by the tuples' identity. Tuples only: they and their Buffers (frozen) cannot change, and the
cache keeps each one alive, so an id is never reused while cached. A list is worked out anew.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.geometry import Component
from transfer.buffers import Buffer, by_component, component_difference
from transfer.errors import LayoutIncompatible

_MAX = 512  # entries per cache (a sender's peers and components: a few dozen)


class _ByIdentity:
    """Values keyed by the identity of some objects, which it keeps alive; cleared when full."""

    def __init__(self) -> None:
        self._d: dict[tuple[int, ...], tuple[tuple, object]] = {}

    def get(self, *objs):
        hit = self._d.get(tuple(map(id, objs)))
        if hit is not None and all(a is b for a, b in zip(hit[0], objs)):
            return hit[1]
        return None

    def put(self, objs: tuple, value):
        if len(self._d) >= _MAX:
            self._d.clear()
        self._d[tuple(map(id, objs))] = (objs, value)
        return value


@dataclass(frozen=True)
class BufferArrays:
    """One component's buffers on one side, as arrays (int64, read-only, one per buffer)."""

    region: np.ndarray
    item_bytes: np.ndarray
    num_items: int  # the fewest items a buffer holds: an index i names an item of every one
    # exactly when 1 <= i < num_items (0 is the sentinel)


_COMPONENTS, _ARRAYS, _PAIRED = _ByIdentity(), _ByIdentity(), _ByIdentity()


def components_of(bufs: Sequence[Buffer]) -> Mapping[Component, tuple[Buffer, ...]]:
    """The buffers by component, each component's as a tuple (in region order)."""
    hit = _COMPONENTS.get(bufs) if isinstance(bufs, tuple) else None
    if hit is not None:
        return hit
    out = {c: tuple(b) for c, b in by_component(bufs).items()}
    return _COMPONENTS.put((bufs,), out) if isinstance(bufs, tuple) else out


def arrays_of(bufs: tuple[Buffer, ...]) -> BufferArrays:
    hit = _ARRAYS.get(bufs)
    if hit is not None:
        return hit
    region = np.array([b.region for b in bufs], dtype=np.int64)
    item = np.array([b.item_bytes for b in bufs], dtype=np.int64)
    region.setflags(write=False)
    item.setflags(write=False)
    arrays = BufferArrays(region, item, min((b.num_items for b in bufs), default=0))
    return _ARRAYS.put((bufs,), arrays)


def pair(component: Component, src: tuple[Buffer, ...], dst: tuple[Buffer, ...]) -> None:
    """Raises LayoutIncompatible naming the first difference unless one component's buffers
    pair up one to one (transfer.buffers.component_difference); a pairing found good once is
    not compared again."""
    if _PAIRED.get(src, dst) is not None:
        return
    diff = component_difference(component, src, dst)
    if diff:
        raise LayoutIncompatible(diff)
    _PAIRED.put((src, dst), True)
