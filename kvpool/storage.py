"""The buffers of one component on a torch device, with typed per-layer views."""

import math
from dataclasses import dataclass

import numpy as np
import torch

from kvpool.host_memory import zeros as host_zeros
from kvpool.dtypes import torch_dtype
from kvpool.errors import LayoutMismatch
from kvpool.geometry import Component, Segment
from kvpool.indices import check_range
from kvpool.layout import Layout, PackedLayout, pack


@dataclass(frozen=True)
class BufferDescriptor:
    """One registered byte range: item i lives at [ptr + i * item_bytes, + item_bytes)."""

    ptr: int
    nbytes: int
    item_bytes: int
    component: Component
    layer: int | None  # None: a page-major buffer holding every layer of the component
    part: str | None  # "k", "v", "latent", ... for layer-major buffers; None for page-major


class Storage:
    def __init__(
        self, component: Component, segments: list[Segment], layout: Layout, num_items: int, device: torch.device | str
    ):
        self.component = component
        self.num_items = num_items
        self.packed: PackedLayout = pack(segments, layout)
        # buffers[b]: uint8 [num_items, item_bytes[b]] on `device`; item 0 is the sentinel.
        # (host memory on huge pages: kvpool/host_memory.py)
        self.buffers = [host_zeros(num_items * b, device).view(num_items, b) for b in self.packed.item_bytes]
        self._placements = {(p.segment.layer, p.segment.part): p for p in self.packed.placements}

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    def view(self, layer: int, part: str) -> torch.Tensor:
        """Typed view [num_items, *segment.shape] of one (layer, part); writes go to the pool."""
        try:
            p = self._placements[(layer, part)]
        except KeyError:
            raise LayoutMismatch(f"{self.component.value} pool has no layer {layer} part {part!r}") from None
        buf = self.buffers[p.buffer]
        dtype = torch_dtype(p.segment.dtype)
        typed = buf.view(dtype)  # [num_items, item_bytes / itemsize]
        shape = p.segment.shape
        inner = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
        return typed.as_strided((self.num_items, *shape), (typed.stride(0), *inner), p.offset // dtype.itemsize)

    def descriptors(self) -> list[BufferDescriptor]:
        page_major = self.packed.layout is Layout.PAGE_MAJOR
        out = []
        for b, buf in enumerate(self.buffers):
            seg = None if page_major else self.packed.placements[b].segment
            out.append(
                BufferDescriptor(
                    ptr=buf.data_ptr(),
                    nbytes=buf.numel(),
                    item_bytes=buf.shape[1],
                    component=self.component,
                    layer=seg.layer if seg else None,
                    part=seg.part if seg else None,
                )
            )
        return out

    def _index_tensor(self, items: np.ndarray) -> torch.Tensor:
        check_range(items, self.num_items, f"{self.component.value} items")
        return torch.from_numpy(np.array(items, dtype=np.int64)).to(self.device)

    def gather(self, items: np.ndarray) -> tuple[torch.Tensor, ...]:
        """CPU copies [len(items), item_bytes] of the given items, one per buffer."""
        idx = self._index_tensor(items)
        return tuple(buf.index_select(0, idx).cpu() for buf in self.buffers)

    def check_data(self, items: np.ndarray, data: tuple[torch.Tensor, ...]) -> None:
        """Refuse data that does not match gather()'s shapes for `items`."""
        if len(data) != len(self.buffers):
            raise LayoutMismatch(f"{self.component.value}: copy has {len(data)} buffers, pool has {len(self.buffers)}")
        for buf, src in zip(self.buffers, data):
            if src.dtype != torch.uint8 or tuple(src.shape) != (len(items), buf.shape[1]):
                raise LayoutMismatch(
                    f"{self.component.value}: copy shape {tuple(src.shape)} {src.dtype} does not fit "
                    f"{len(items)} items of {buf.shape[1]} bytes"
                )

    def scatter(self, items: np.ndarray, data: tuple[torch.Tensor, ...]) -> None:
        """Write `data` (as returned by gather) into the given items."""
        self.check_data(items, data)
        idx = self._index_tensor(items)
        for buf, src in zip(self.buffers, data):
            buf.index_copy_(0, idx, src.to(buf.device))

    def has(self, layer: int, part: str) -> bool:
        return (layer, part) in self._placements
