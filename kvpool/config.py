"""One frozen PoolConfig per pool: model geometry, page size, TP shard, capacity, layout.

Capacity is given either in tokens (`max_tokens`, full-attention tokens) or as a byte budget
(`byte_budget`, everything the pool allocates). Either way `sizes()` resolves it to item counts:

    full pages    = tokens / page_size          (NSA shares the full page indices)
    swa pages     = full pages * swa_ratio      (at least one window per request)
    state slots   = max_requests                (Mamba state, AUX row)

and a byte budget B solves  B = (full_pages + 1) * (full_row + nsa_row)
                              + (swa_pages + 1) * swa_row + (max_requests + 1) * (mamba_row + aux_row)
(+1: the sentinel item of every component).
"""

from dataclasses import dataclass

import torch

from kvpool.components import SPECS, Component, Items
from kvpool.geometry import components, segments
from kvpool.layout import Layout, pack
from kvpool.errors import SpecError
from kvpool.shards import Shard
from kvpool.spec import ModelSpec, check_page_size


def resolve_device(device: str) -> str:
    """ "auto" -> cuda where torch sees a GPU, else cpu; any other name as it is."""
    return ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device


@dataclass(frozen=True)
class PoolSizes:
    full_pages: int
    swa_pages: int
    state_slots: int

    def count(self, items: Items) -> int:
        """How many items of this kind the pool holds (the sentinel item not counted)."""
        return {
            Items.FULL_PAGES: self.full_pages,
            Items.SWA_PAGES: self.swa_pages,
            Items.REQUEST_SLOTS: self.state_slots,
        }[items]

    def num_items(self, component: Component) -> int:
        """Items a component's buffers hold, the sentinel item 0 included."""
        return self.count(SPECS[component].items) + 1


@dataclass(frozen=True)
class PoolConfig:
    model: ModelSpec
    page_size: int
    tp_size: int = 1
    tp_rank: int = 0
    max_tokens: int | None = None
    byte_budget: int | None = None
    max_requests: int = 16
    swa_ratio: float = 0.5
    layout: Layout = Layout.PAGE_MAJOR
    device: str = "auto"  # "auto": cuda when torch sees a GPU, else cpu

    def __post_init__(self) -> None:
        check_page_size(self.page_size)
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise SpecError(f"tp_size must be a positive int, got {self.tp_size!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise SpecError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")
        if (self.max_tokens is None) == (self.byte_budget is None):
            raise SpecError("give exactly one of max_tokens and byte_budget")
        for name in ("max_tokens", "byte_budget"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise SpecError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.max_requests, int) or self.max_requests < 1:
            raise SpecError(f"max_requests must be a positive int, got {self.max_requests!r}")
        if not 0 < self.swa_ratio <= 1:
            raise SpecError(f"swa_ratio must lie in (0, 1], got {self.swa_ratio!r}")
        object.__setattr__(self, "layout", Layout(self.layout))  # accept "page_major" too
        object.__setattr__(self, "device", resolve_device(self.device))
        for c in self.components:  # TP divisibility, dtypes
            segments(self.model, c, self.page_size, self.tp_size)
        self.sizes()  # capacity fits

    @property
    def shard(self) -> Shard:
        """This pool's side of a transfer: page size and TP (size, rank)."""
        return Shard(self.page_size, self.tp_size, self.tp_rank)

    @property
    def components(self) -> tuple[Component, ...]:
        return components(self.model)

    def row_bytes(self, component: Component) -> int:
        """Bytes one item of `component` occupies on this shard (layout padding included)."""
        segs = segments(self.model, component, self.page_size, self.tp_size)
        return pack(segs, self.layout).row_bytes

    def swa_window_pages(self) -> int:
        """Most SWA pages one request's window can span (one extra for misalignment)."""
        assert self.model.swa is not None and self.model.swa.window is not None
        return -(-self.model.swa.window // self.page_size) + 1

    def sizes(self) -> PoolSizes:
        rows = {items: 0 for items in Items}  # bytes per item of each kind, over its components
        for c in self.components:
            rows[SPECS[c].items] += self.row_bytes(c)
        per_page, swa_row, per_request = (rows[i] for i in (Items.FULL_PAGES, Items.SWA_PAGES, Items.REQUEST_SLOTS))
        has_paged, has_swa = per_page + swa_row > 0, swa_row > 0
        if self.max_tokens is not None:
            full_pages = self.max_tokens // self.page_size
        else:
            fixed = (self.max_requests + 1) * per_request + per_page + swa_row
            left = self.byte_budget - fixed
            if left < 0:
                raise SpecError(
                    f"byte budget {self.byte_budget} too small: {fixed} bytes go to "
                    f"{self.max_requests} request slots and sentinels alone"
                )
            full_pages = int(left // (per_page + self.swa_ratio * swa_row)) if has_paged else 0
        swa_pages = int(full_pages * self.swa_ratio) if has_swa else 0
        if self.max_tokens is not None and has_swa:  # a token capacity: at least one window
            swa_pages = max(swa_pages, min(full_pages, self.swa_window_pages()))
        if has_paged and full_pages < 1:
            raise SpecError(f"capacity holds no page of {self.page_size} tokens")
        if has_swa and swa_pages < self.swa_window_pages():
            raise SpecError(
                f"swa pool of {swa_pages} pages cannot hold one window of "
                f"{self.model.swa.window} tokens ({self.swa_window_pages()} pages); raise capacity or swa_ratio"
            )
        return PoolSizes(full_pages=full_pages, swa_pages=swa_pages, state_slots=self.max_requests)
