"""Packing a component's segments into registered buffers: page-major or layer-major.

Every buffer is a 2-D byte array [num_items, item_bytes]; item i of a buffer starts at
ptr + i * item_bytes. The two layouts differ only in how segments map to buffers:

  PAGE_MAJOR (default): one buffer per component, one item = one page of every layer
      buffer 0, item p:  | L0.k | L0.v | L2.k | L2.v | ... |   <- one contiguous range
  LAYER_MAJOR (what SGLang/vLLM allocate): one buffer per (layer, part)
      buffer 0 = L0.k [num_items, page bytes], buffer 1 = L0.v, buffer 2 = L2.k, ...

Moving one page costs one byte range in PAGE_MAJOR and 2 x num_layers ranges in
LAYER_MAJOR, and a transfer's cost is dominated by its range count (see docs/architecture.md).
Segment offsets inside a page-major item are aligned to ALIGN bytes so every typed per-layer
view is aligned for vectorized kernels.
"""

from dataclasses import dataclass
from enum import Enum

from kvpool.geometry import Segment

ALIGN = 16


class Layout(str, Enum):
    PAGE_MAJOR = "page_major"
    LAYER_MAJOR = "layer_major"


@dataclass(frozen=True)
class Placement:
    segment: Segment
    buffer: int  # which buffer of the component
    offset: int  # byte offset of the segment inside one item of that buffer


@dataclass(frozen=True)
class PackedLayout:
    layout: Layout
    item_bytes: tuple[int, ...]  # per buffer
    placements: tuple[Placement, ...]  # one per segment, in segment order

    @property
    def row_bytes(self) -> int:
        """Bytes of one item summed over all buffers (padding included)."""
        return sum(self.item_bytes)


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def pack(segments: list[Segment], layout: Layout) -> PackedLayout:
    if layout is Layout.LAYER_MAJOR:
        return PackedLayout(
            layout,
            tuple(s.nbytes for s in segments),
            tuple(Placement(s, i, 0) for i, s in enumerate(segments)),
        )
    placements, offset = [], 0
    for s in segments:
        offset = _round_up(offset, ALIGN)
        placements.append(Placement(s, 0, offset))
        offset += s.nbytes
    return PackedLayout(layout, (_round_up(offset, ALIGN),), tuple(placements))
