r"""Transfers between pools of different page sizes: token rows instead of pages.

A page of one side is not a page of the other, so a paged component moves token by token
(in runs): each side's pages become token rows, by position in the request.

    a side of page size P whose index array idx covers the request's last len(idx) pages
    (FULL and NSA: every page; SWA: the window's), for a request of n tokens:
        pages of the request   ceil(n / P);  first covered page  f = ceil(n / P) - len(idx)
        row of position p      idx[p // P - f] * P + p % P
    positions moved: [max(f_src * P_src, f_dst * P_dst), n): what both sides cover, so each
    side writes or reads only its own pages (positions past n move nowhere)

A lane is one segment of a component (one layer's K, V, latent, indexer key, ...) seen as
token rows on one side:

    row t = bytes [(t // P) * pitch + offset + (t % P) * token_bytes, + token_bytes) of the buffer
    layer-major: offset 0 and pitch = P * token_bytes, so rows are back to back across pages
    page-major:  | L0.k: P rows | L0.v: P rows | L1.k ... |   one page (pitch bytes)
                 a page's rows of one segment are back to back, the next page's a pitch away:
                 runs break where a page ends on either side

Both sides name lanes alike (lane i = segment i of the component, in the model's order), so
a staged piece says (lane, first position, count) and each side finds its own bytes.
"""

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kvpool.geometry import Component, segments
from kvpool.layout import Layout, pack
from kvpool.spec import ModelSpec
from transfer.buffers import Buffer
from transfer.errors import IndexMismatch, LayoutIncompatible, OutOfBounds


@dataclass(frozen=True)
class Lane:
    """One segment of a component (or a TP slice of it) as token rows on one side."""

    buffer: int  # which of the component's buffers holds it
    region: int  # that buffer's region
    num_items: int  # that buffer's items (pages, the sentinel included)
    layer: int
    part: str  # the segment's part ("k", "conv", ...)
    offset: int  # bytes into each item where the lane's first row starts
    pitch: int  # bytes of one item of the buffer
    page_size: int  # token rows per item (a state slot: one row)
    token_bytes: int  # bytes of one row that move (a TP slice: part of the segment's row)
    stride: int  # bytes from one row of a page to the next (the segment's whole row)
    head: int = -1  # a head-outer engine block (transfer.engine_rows): the rank's head this lane
    # is (its segment's heads are lanes of their own, paired head by head); -1: every head of the row

    @property
    def linear(self) -> bool:
        """Whole rows back to back across pages (layer-major): row t at t * token_bytes."""
        return self.offset == 0 and self.stride == self.token_bytes and self.pitch == self.page_size * self.token_bytes

    def at(self, rows: np.ndarray) -> np.ndarray:
        """Byte offset of each row in the buffer (int64)."""
        rows = np.asarray(rows, dtype=np.int64)
        return rows // self.page_size * self.pitch + self.offset + rows % self.page_size * self.stride

    def slice(self, offset: int, nbytes: int) -> "Lane":
        """Bytes [offset, offset + nbytes) of every row (kvpool.shards: a TP slice)."""
        if offset == 0 and nbytes == self.token_bytes:
            return self
        return dataclasses.replace(self, offset=self.offset + offset, token_bytes=nbytes)


def lanes(
    model: ModelSpec,
    component: Component,
    page_size: int,
    tp_size: int,
    layout: Layout,
    bufs: list[Buffer],
    *,
    side: str,
) -> tuple[Lane, ...]:
    """The lanes of a side whose pool holds `model` at `page_size` in `layout`. Its buffers
    must be exactly what that pool allocates (count, layer, part, item bytes), else
    LayoutIncompatible: a peer's buffers are its claim, checked here before any offset is
    derived from them."""
    segs = segments(model, component, page_size, tp_size)
    packed = pack(segs, Layout(layout))
    want = [
        (
            None if packed.layout is Layout.PAGE_MAJOR else pl.segment.layer,
            None if packed.layout is Layout.PAGE_MAJOR else pl.segment.part,
        )
        for pl in packed.placements
    ]
    if packed.layout is Layout.PAGE_MAJOR:
        want = want[:1]
    got = [(b.layer, b.part) for b in bufs]
    sizes = [b.item_bytes for b in bufs]
    if got != want or sizes != list(packed.item_bytes):
        raise LayoutIncompatible(
            f"{component.value}: the {side} buffers are not those of {model.name} at page size "
            f"{page_size} ({len(bufs)} buffers of {sizes[:4]} B/item, expected "
            f"{len(packed.item_bytes)} of {list(packed.item_bytes)[:4]})"
        )
    rows = 1 if component.per_request else page_size  # a state slot is one row
    return tuple(
        Lane(
            pl.buffer,
            bufs[pl.buffer].region,
            bufs[pl.buffer].num_items,
            pl.segment.layer,
            pl.segment.part,
            pl.offset,
            packed.item_bytes[pl.buffer],
            rows,
            pl.segment.nbytes // rows,
            pl.segment.nbytes // rows,
        )
        for pl in packed.placements
    )


def first_covered(num_tokens: int, page_size: int, length: int, side: str, component: Component) -> int:
    """The first position a side's index array of `length` pages covers (it covers the last ones)."""
    pages = -(-num_tokens // page_size)
    if length > pages:
        raise IndexMismatch(
            f"{component.value}: {length} {side} pages for {num_tokens} tokens of {page_size} (at most {pages})"
        )
    return (pages - length) * page_size


def rows(idx: np.ndarray, num_tokens: int, page_size: int, positions: np.ndarray) -> np.ndarray:
    """Token rows (int64) of `positions` on a side whose index array `idx` covers the request's
    last len(idx) pages; every position must be covered (the caller checked)."""
    first_page = -(-num_tokens // page_size) - len(idx)
    pages = np.asarray(idx, dtype=np.int64)[positions // page_size - first_page]
    return pages * page_size + positions % page_size


def span_rows(idx: np.ndarray, num_tokens: int, page_size: int, first: int) -> np.ndarray:
    """rows(idx, num_tokens, page_size, arange(first, num_tokens)), page by page: one gather
    of pages and one broadcast, not a gather, a division and a remainder per position (the
    planner's by-token sends ask it per component and side: 32k positions)."""
    if first >= num_tokens:
        return np.zeros(0, dtype=np.int64)
    first_page = -(-num_tokens // page_size) - len(idx)
    lo, hi = first // page_size, -(-num_tokens // page_size)
    pages = np.asarray(idx[lo - first_page : hi - first_page], dtype=np.int64) * page_size
    out = (pages[:, None] + np.arange(page_size, dtype=np.int64)).reshape(-1)
    return out[first - lo * page_size : num_tokens - lo * page_size]


def check_pages(component: Component, side: str, idx: np.ndarray, num_items: int) -> None:
    """Every page a side's rows fall in is a real item of its buffers (0 is the sentinel):
    `num_items`, the fewest items of the side's lanes' buffers (the lane pairing's, worked
    out once per peer; the indices are every request's own, checked on every send)."""
    if len(idx) == 0:
        return
    idx = np.asarray(idx)  # (the ndarray's own min / max: numpy's wrappers cost more than 2k pages)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 1 or hi >= num_items:
        raise OutOfBounds(f"{component.value}: {side} page {lo if lo < 1 else hi} outside [1, {num_items - 1}]")


@dataclass(frozen=True, eq=False)
class SpanRows:
    """span_rows(idx, num_tokens, page_size, first), worked out only where asked: a direct send
    needs only the rows where its runs start (at(), O(pages)), a staged one slices of them
    (gather), and only tests the whole array. `pages` are the side's pages from the one
    holding `first` on (a copy, read-only: the caller's index array may change later)."""

    pages: np.ndarray  # int64, read-only
    num_tokens: int
    page_size: int
    first: int

    @staticmethod
    def of(idx: np.ndarray, num_tokens: int, page_size: int, first: int) -> "SpanRows":
        first = min(first, num_tokens)
        first_page = -(-num_tokens // page_size) - len(idx)
        lo, hi = first // page_size, -(-num_tokens // page_size)
        pages = np.array(idx[lo - first_page : hi - first_page], dtype=np.int64)
        pages.setflags(write=False)
        return SpanRows(pages, num_tokens, page_size, first)

    def __len__(self) -> int:
        return self.num_tokens - self.first

    def at(self, positions: np.ndarray) -> np.ndarray:
        """Rows (int64) of request positions, each in [first, num_tokens)."""
        base = self.first // self.page_size
        return self.pages[positions // self.page_size - base] * self.page_size + positions % self.page_size

    @functools.cached_property
    def _all(self) -> np.ndarray:
        out = span_rows(self.pages, self.num_tokens, self.page_size, self.first)
        out.setflags(write=False)
        return out

    def starts(self, step: int) -> np.ndarray:
        """Rows of positions first, first + step, ... (below num_tokens): at() of them, and where
        `step` is this side's page size and `first` starts a page, its pages' first rows (no
        division: the planner asks it per component and side on every by-token send)."""
        if step == self.page_size and self.first % step == 0:
            return self.pages * step
        return self.at(np.arange(self.first, self.num_tokens, step, dtype=np.int64))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self._all if dtype is None else self._all.astype(dtype)

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            lo, hi, _ = key.indices(len(self))
            return self.at(np.arange(self.first + lo, self.first + max(lo, hi), dtype=np.int64))
        return self._all[key]

    def __iter__(self):
        return iter(self._all)

    def tolist(self) -> list[int]:
        return self._all.tolist()


@dataclass(frozen=True)
class TokenRows:
    """A receiver's side of staged pieces: its lanes, the request's length, and the positions
    it holds already (its prefix, transfer.suffix: no piece may write below prefix_len)."""

    num_tokens: int
    lanes: Mapping[Component, tuple[Lane, ...]]
    prefix_len: int = 0


@dataclass(frozen=True)
class Tokens:
    """What the planner needs to move a request by lane: the request's length and each side's
    lanes per component (lane i of src pairs with lane i of dst). Pools of different page
    sizes: every paged component's segments. TP shards (`sliced`, transfer.reshard): the
    slices this pair owns of every component; one absent is not this sender's to send."""

    num_tokens: int
    src: Mapping[Component, tuple[Lane, ...]]
    dst: Mapping[Component, tuple[Lane, ...]]
    sliced: bool = False


def pool_lanes(
    model: ModelSpec, page_size: int, tp_size: int, layout: Layout, bufs: list[Buffer], side: str
) -> dict[Component, tuple[Lane, ...]]:
    """Lanes of every component of a side (its buffers checked, see lanes()); a state slot or
    AUX row is one row (moved by lane only between TP shards of different sizes)."""
    by_c: dict[Component, list[Buffer]] = {}
    for b in bufs:
        by_c.setdefault(Component(b.component), []).append(b)
    return {c: lanes(model, c, page_size, tp_size, layout, bs, side=side) for c, bs in by_c.items()}
