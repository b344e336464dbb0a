r"""Gathered sends: the sender gathers, the link writes straight into the receiver's pages.

Where one sender covers the whole of a receiver's row (TP 1 -> 8, 1 -> 2, 2 -> 8, ...; also
equal TP at another page size), a staged piece's destination is whole rows of the receiver's
pages: contiguous there. So the sender gathers a chunk into a local staging slot laid out as
an IMAGE of the receiver's pages, and writes each run of consecutive destination pages with
one range: no receiver slot, no scatter, no chunk notice or ack (two copies, not three).

    receiver page (page-major, a TP 8 rank):  | L0.k: P rows | L0.v: P rows | L1.k ... |  pitch
    local slot, one chunk:                    | page image 0 | page image 1 | ...        (per region)
        image of a page = the region's lanes' bytes [lo, lo + width) of one page, lane j's
        row r at (offset_j - lo) + r * token_bytes: the receiver's own layout
    ranges:  a run of consecutive pages -> one range where the image is the whole item (a
             page the request covers only partly, its last or a window's first, goes whole
             too, its other rows zero: rows of no position the receiver holds); else one
             range per page and run of covered bytes, partial pages lane by lane

Rows are gathered in units of u = min(page sizes) rows (one page of the smaller side: a unit
is contiguous on both sides); units consecutive on both sides go as one slice copy per run
and band of lanes, short runs of units under FANCY_BELOW_ROWS rows in one fancy-indexed copy.
Plan-only: every destination offset comes from the validated plan's rows (check_pages) and
its receiver lanes (inside their items, checked here); the link checks each range again.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kvpool.geometry import Component
from transfer.layers import LayerGroup
from transfer.plan import ComponentPlan
from transfer.tokens import Lane
from transfer.transports.ranges import Ranges

ALIGN = 16  # region images in a slot start at multiples of this
# units of fewer rows in runs this short go in one fancy-indexed copy, else a slice copy per
# run: numpy's fancy indexing moved 1/8-head rows at ~4 GB/s, slice copies of 16-row units
# at ~12 GB/s (gpt-oss-120b, TP 8 share), a Python loop per 1-row unit would cost more
FANCY_BELOW_ROWS = 8


@dataclass(frozen=True)
class _Band:
    """Lanes [lo, lo + n) of a component: one source buffer at one step, one receiver region
    at one step (what one strided view moves on each side)."""

    lo: int
    n: int
    src: np.ndarray  # [lanes, items, units per item, u] rows (void) over the source pool
    region: int  # index into the component's regions
    img_off: int  # lane lo's row 0 in the region's page image
    img_step: int  # bytes from one lane to the next in the image
    token_bytes: int


@dataclass(frozen=True)
class _Region:
    """A receiver region's share of a component: its lanes' bytes [lo, lo + width) of an item."""

    region: int  # the receiver's region id
    pitch: int  # bytes of one receiver item
    lo: int
    width: int
    lanes: np.ndarray  # the component's lane indices in this region
    offsets: np.ndarray  # their receiver offsets (bytes into an item)
    token_bytes: np.ndarray
    span_off: np.ndarray  # runs of bytes the lanes cover: offsets from lo
    span_len: np.ndarray


@dataclass(frozen=True)
class _Moves:
    """A chunk's units, the same for every band: image (page k, unit q) <- source (item i,
    unit s). Runs of units consecutive on both sides (along one axis each: items or the
    units of one page) go as one slice copy each; where runs are short (a side of page size
    1 whose pages are scattered), every unit in one fancy-indexed copy (k, q, i, s)."""

    runs: tuple[tuple[int, int, int, int, int], ...]  # (k, q, i, s, units)
    src_items: bool  # a source run advances over items (else over the units of one item)
    dst_pages: bool  # an image run advances over pages (else over the units of one page)
    fancy: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None
    partial: tuple[tuple[int, int, int, int, int], ...]  # (k, q, i, s, rows) of a short last unit

    def copy(self, img: np.ndarray, src: np.ndarray) -> None:
        if self.fancy is not None:
            k, q, i, s = self.fancy
            img[:, k, q] = src[:, i, s]
        for k, q, i, s, c in self.runs:
            into = img[:, k : k + c, q] if self.dst_pages else img[:, k, q : q + c]
            into[...] = src[:, i : i + c, s] if self.src_items else src[:, i, s : s + c]
        for k, q, i, s, rows in self.partial:
            img[:, k, q, :rows] = src[:, i, s, :rows]


def _moves(units: "_Units", a: int, b: int, k: np.ndarray, *, per_src: int, per_dst: int, u: int) -> _Moves:
    """Units [a, b) of a component (k: their pages in the chunk) as runs or one fancy copy."""
    i, s, q, rows = units.src_item[a:b], units.src_sub[a:b], units.dst_sub[a:b], units.rows[a:b]
    full = rows == u
    partial = tuple((int(k[t]), int(q[t]), int(i[t]), int(s[t]), int(rows[t])) for t in np.flatnonzero(~full))
    i, s, q, k = i[full], s[full], q[full], k[full]
    if not len(k):
        return _Moves((), True, True, None, partial)
    step = (np.diff(i * per_src + s) == 1) & (np.diff(k * per_dst + q) == 1)
    if per_src > 1:
        step &= np.diff(i) == 0
    if per_dst > 1:
        step &= np.diff(k) == 0
    first = np.concatenate(([0], np.flatnonzero(~step) + 1))
    if u < FANCY_BELOW_ROWS and len(first) * 4 > len(k):  # many short runs of few rows: one fancy copy
        return _Moves((), True, True, (k, q, i, s), partial)
    count = np.diff(np.concatenate((first, [len(k)])))
    runs = tuple(zip(*(x.tolist() for x in (k[first], q[first], i[first], s[first], count))))
    return _Moves(runs, per_src == 1, per_dst == 1, None, partial)


@dataclass(frozen=True)
class _Copy:
    """One band's units of one chunk (the chunk's moves, over the band's views)."""

    band: _Band
    base: int  # the band's region image in the slot
    pages: int  # pages in the chunk
    width: int
    per_page: int  # units per receiver page
    u: int
    moves: _Moves

    def run(self, slot: np.ndarray) -> None:
        b = self.band
        img = np.lib.stride_tricks.as_strided(
            slot[self.base + b.img_off :],
            (b.n, self.pages, self.per_page, self.u, b.token_bytes),
            (b.img_step, self.width, self.u * b.token_bytes, b.token_bytes, 1),
        ).view(np.dtype((np.void, b.token_bytes)))[..., 0]
        self.moves.copy(img, b.src)


@dataclass(frozen=True)
class GatheredChunk:
    layers_needed: int  # streamed: model layers [0, n) must be final before it is gathered
    nbytes: int  # slot bytes it fills
    copies: tuple[_Copy, ...]
    ranges: Ranges  # source offsets from the slot's start (src_region: set at the write)
    zero: tuple[tuple[int, int], ...] = ()  # (offset, bytes) of page images written whole, partly gathered

    def gather(self, slot: torch.Tensor) -> None:
        """Its page images into `slot` (a host tensor): one copy per band."""
        data = slot.numpy()
        for off, n in self.zero:
            data[off : off + n] = 0
        for c in self.copies:
            c.run(data)


@dataclass(frozen=True)
class GatherPlan:
    """A send's gathered chunks, per layer group (in order), and how many ranges they write."""

    chunks: tuple[tuple[GatheredChunk, ...], ...]  # per group
    num_ranges: int

    @property
    def num_chunks(self) -> int:
        return sum(len(g) for g in self.chunks)


def gather_plan(
    groups: Sequence[LayerGroup],
    slot_bytes: int,
    tensors: dict[Component, list[torch.Tensor]],
    streamed: bool,
    cache: dict | None = None,
) -> GatherPlan | None:
    """The by-token components of `groups` as gathered chunks of <= slot_bytes, or None where
    a send cannot go so (no by-token component; one whose receiver lanes are not whole rows
    tiling their items' bytes; pages not aligned; a receiver page wider than a slot; a pool
    not in host memory). Whole-item components are not gathered (they go direct). `cache`:
    the caller's, kept across sends from one pool (lane pairings' layouts)."""
    out, ranges, any_token, cache = [], 0, False, {} if cache is None else cache
    for g in groups:
        chunks: list[GatheredChunk] = []
        for cp in g.body:
            if not cp.by_token:
                continue
            any_token = True
            got = _component(cp, slot_bytes, tensors[cp.component], g.layers.stop if streamed else 0, cache)
            if got is None:
                return None
            chunks += got
        ranges += sum(len(c.ranges) for c in chunks)
        out.append(tuple(chunks))
    return GatherPlan(tuple(out), ranges) if any_token else None


def _regions(dst: tuple[Lane, ...]) -> list[_Region] | None:
    """The receiver's regions of a component's lanes: each lane's rows whole (back to back
    in a page, or one row per item), no two lanes overlapping, all inside the item; else None.
    A region's image spans its lanes' bytes [lo, lo + width) of an item; its `spans` are the
    runs of bytes the lanes cover (alignment padding between lanes is never written)."""
    by: dict[int, list[int]] = {}
    for j, lane in enumerate(dst):
        if (lane.stride != lane.token_bytes and lane.page_size != 1) or lane.offset < 0:
            return None
        by.setdefault(lane.region, []).append(j)
    out = []
    for region, js in by.items():
        js.sort(key=lambda j: dst[j].offset)
        starts = np.array([dst[j].offset for j in js], dtype=np.int64)
        ends = starts + np.array([dst[j].page_size * dst[j].token_bytes for j in js], dtype=np.int64)
        pitch = dst[js[0]].pitch
        if (starts[1:] < ends[:-1]).any() or ends[-1] > pitch or any(dst[j].pitch != pitch for j in js):
            return None
        cut = np.flatnonzero(starts[1:] != ends[:-1]) + 1
        span_lo = starts[np.concatenate(([0], cut))]
        span_hi = ends[np.concatenate((cut - 1, [len(js) - 1]))]
        tb = np.array([dst[j].token_bytes for j in js], dtype=np.int64)
        lo = int(starts[0])
        out.append(
            _Region(region, pitch, lo, int(ends[-1]) - lo, np.array(js), starts, tb, span_lo - lo, span_hi - span_lo)
        )
    return out


def _layout(src: tuple[Lane, ...], dst: tuple[Lane, ...], tensors: list[torch.Tensor], u: int, cache: dict):
    """(regions, bands) of a lane pairing (None: not gatherable), worked out once per pairing
    in the caller's `cache` (a sender's: its pool's tensors): a peer's lanes are the same
    tuples for every send (keyed by identity, the lanes kept beside so an id is not reused
    while cached; a few hundred pairings at most)."""
    key = (id(src), id(dst), u)
    hit = cache.get(key)
    if hit is not None and hit[0] is src and hit[1] is dst:
        return hit[2]
    regions = _regions(dst)
    bands = _bands(src, regions, tensors, u) if regions is not None else None
    layout = (regions, bands) if bands is not None else None
    if len(cache) >= 256:
        cache.clear()
    cache[key] = (src, dst, layout)
    return layout


def _bands(src: tuple[Lane, ...], regions: list[_Region], tensors: list[torch.Tensor], u: int) -> list[_Band] | None:
    """The component's lanes cut into bands (a fixed step on both sides, one source buffer,
    one receiver region), with their source views."""
    where = {int(j): (ri, int(r.offsets[k]) - r.lo) for ri, r in enumerate(regions) for k, j in enumerate(r.lanes)}
    cuts = []
    for j in range(len(src)):
        if cuts and _extends(cuts[-1], j, src, where):
            cuts[-1][1] += 1
        else:
            cuts.append([j, 1])
    out = []
    for lo, n in cuts:
        first, buf = src[lo], tensors[src[lo].buffer]
        if buf.device.type != "cpu" or first.page_size % u:
            return None
        s_step = src[lo + 1].offset - first.offset if n > 1 else 0
        ri, img_off = where[lo]
        i_step = where[lo + 1][1] - img_off if n > 1 else 0
        flat = buf.numpy().reshape(-1)
        view = np.lib.stride_tricks.as_strided(
            flat[first.offset :],
            (n, buf.shape[0], first.page_size // u, u, first.token_bytes),
            (s_step, first.pitch, u * first.stride, first.stride, 1),
        ).view(np.dtype((np.void, first.token_bytes)))[..., 0]
        out.append(_Band(lo, n, view, ri, img_off, i_step, first.token_bytes))
    return out


def _extends(cut: list[int], j: int, src: tuple[Lane, ...], where: dict) -> bool:
    """Whether lane j continues the band cut [lo, lo + n) on both sides."""
    lo, n = cut
    a, b = src[lo], src[j]
    if (a.buffer, a.pitch, a.stride, a.token_bytes, a.page_size) != (
        b.buffer,
        b.pitch,
        b.stride,
        b.token_bytes,
        b.page_size,
    ):
        return False
    if where[lo][0] != where[j][0]:
        return False
    s_step = (src[lo + 1].offset - a.offset) if n > 1 else b.offset - a.offset
    i_step = (where[lo + 1][1] - where[lo][1]) if n > 1 else where[j][1] - where[lo][1]
    return s_step > 0 and i_step > 0 and b.offset == a.offset + n * s_step and where[j][1] == where[lo][1] + n * i_step


@dataclass(frozen=True)
class _Units:
    """A component's rows in units of u rows: per unit its source (item, unit in the item) and
    receiver (page, unit in the page) and rows; per receiver page group (units of one page)
    its page, first row, rows."""

    rows: np.ndarray
    src_item: np.ndarray
    src_sub: np.ndarray
    dst_sub: np.ndarray
    group: np.ndarray  # each unit's page group
    g_start: np.ndarray  # first unit of each group
    g_page: np.ndarray
    g_row: np.ndarray
    g_rows: np.ndarray


def _units(cp: ComponentPlan, u: int, ps: int, pd: int) -> _Units | None:
    """The plan's rows in units (None: a unit's rows not consecutive, or one crossing a page)."""
    s, d = np.asarray(cp.src_idx, dtype=np.int64), np.asarray(cp.dst_idx, dtype=np.int64)
    n = len(d)
    starts = np.arange(0, n, u, dtype=np.int64)
    rows = np.minimum(u, n - starts)
    us, ud = s[starts], d[starts]
    step = np.arange(n, dtype=np.int64) - np.repeat(starts, rows)
    if (us % u).any() or (ud % u).any() or (s != np.repeat(us, rows) + step).any():
        return None
    if (d != np.repeat(ud, rows) + step).any():
        return None
    page = ud // pd
    g_start = np.concatenate(([0], np.flatnonzero(np.diff(page)) + 1)).astype(np.int64)
    group = np.cumsum(np.concatenate(([0], (np.diff(page) != 0).astype(np.int64))))
    dst_sub = (ud % pd) // u
    if (dst_sub != dst_sub[g_start][group] + (np.arange(len(starts)) - g_start[group])).any():
        return None  # a page's units are not consecutive rows of it (a page named twice)
    g_rows = np.add.reduceat(rows, g_start)
    return _Units(rows, us // ps, (us % ps) // u, dst_sub, group, g_start, page[g_start], ud[g_start] % pd, g_rows)


def gatherable(
    pairings: Iterable[tuple[tuple[Lane, ...], tuple[Lane, ...], list[torch.Tensor]]],
    slot_bytes: int,
    cache: dict | None = None,
) -> bool:
    """Whether every lane pairing (source lanes, receiver lanes, the source tensors) of a
    peer's by-token components can go gathered: what gather_plan checks of a send that does
    not depend on its rows (lanes whole rows, page sizes, a receiver page fits a slot, the
    pool in host memory). A send of such a peer can still fail the rest (gather_plan: rows
    not in whole units)."""
    cache = {} if cache is None else cache
    return all(_pairing(src, dst, tensors, slot_bytes, cache) is not None for src, dst, tensors in pairings)


def _pairing(
    src: tuple[Lane, ...], dst: tuple[Lane, ...], tensors: list[torch.Tensor], slot_bytes: int, cache: dict
) -> tuple[list[_Region], list[_Band], int, int] | None:
    """(regions, bands, unit rows u, receiver pages per chunk) of a gatherable lane pairing;
    None where it is not."""
    ps, pd = src[0].page_size, dst[0].page_size
    u = min(ps, pd)
    if max(ps, pd) % u or any(l.page_size != pd for l in dst):
        return None
    layout = _layout(src, dst, tensors, u, cache)
    if layout is None:
        return None
    regions, bands = layout
    m = (slot_bytes - ALIGN * len(regions)) // sum(r.width for r in regions)
    return (regions, bands, u, m) if m >= 1 else None


def _component(
    cp: ComponentPlan, slot_bytes: int, tensors: list[torch.Tensor], layers_needed: int, cache: dict
) -> list[GatheredChunk] | None:
    """One by-token component's chunks, or None where it cannot be gathered."""
    pairing = _pairing(cp.src_lanes, cp.dst_lanes, tensors, slot_bytes, cache)
    if pairing is None or len(cp.dst_idx) == 0:
        return None if pairing is None else []
    regions, bands, u, m = pairing
    pd = cp.dst_lanes[0].page_size
    units = _units(cp, u, cp.src_lanes[0].page_size, pd)
    if units is None:
        return None
    shape = _Shape(regions, bands, units, u, pd)
    groups = len(units.g_start)
    return [_chunk(shape, g0, min(groups, g0 + m), layers_needed) for g0 in range(0, groups, m)]


@dataclass(frozen=True)
class _Shape:
    """A gatherable component: its receiver regions, bands of lanes, rows in units of u rows,
    and the receiver's page size."""

    regions: list[_Region]
    bands: list[_Band]
    units: _Units
    u: int
    pd: int


def _chunk(shape: _Shape, g0: int, g1: int, layers_needed: int) -> GatheredChunk:
    """Page groups [g0, g1) of a component as one chunk: its copies and ranges."""
    regions, bands, units, u, pd = shape.regions, shape.bands, shape.units, shape.u, shape.pd
    pages = g1 - g0
    bases, at = [], 0
    for r in regions:
        bases.append(at)
        at = -(-(at + pages * r.width) // ALIGN) * ALIGN
    a = int(units.g_start[g0])
    b = int(units.g_start[g1]) if g1 < len(units.g_start) else len(units.rows)
    k = units.group[a:b] - g0
    per_src = bands[0].src.shape[2] if bands else 1
    moves = _moves(units, a, b, k, per_src=per_src, per_dst=pd // u, u=u)
    copies = [_Copy(band, bases[band.region], pages, regions[band.region].width, pd // u, u, moves) for band in bands]
    g = slice(g0, g1)
    parts = [
        _region_ranges(r, base, units.g_page[g], units.g_row[g], units.g_rows[g], pd) for r, base in zip(regions, bases)
    ]
    zero = tuple(z for _, zs in parts for z in zs)
    return GatheredChunk(layers_needed, at, tuple(copies), Ranges.concat([p for p, _ in parts]), zero)


def _region_ranges(
    r: _Region, base: int, page: np.ndarray, row: np.ndarray, rows: np.ndarray, pd: int
) -> tuple[Ranges, list[tuple[int, int]]]:
    """A chunk's ranges into one receiver region, and the page images to zero before the
    gather. Where the image is the whole item: runs of consecutive pages, one range each, a
    page the request covers only partly written whole, its other rows zero (rows of no
    position the receiver holds: past the request's end, or below what both sides cover in
    a window's first page). Else one range per page and span, partial pages lane by lane."""
    k = np.arange(len(page), dtype=np.int64)
    filled = len(r.span_len) == 1 and r.width == r.pitch
    whole = (rows == pd) | filled
    zero = [(int(base + kk * r.width), r.width) for kk in k[rows != pd]] if filled else []
    kw, pw = k[whole], page[whole]
    if filled and len(kw):  # runs of pages
        cut = np.flatnonzero((np.diff(pw) != 1) | (np.diff(kw) != 1)) + 1
        first = np.concatenate(([0], cut))
        count = np.diff(np.concatenate((first, [len(kw)])))
        src, dst, length = base + kw[first] * r.width, pw[first] * r.pitch + r.lo, count * r.width
    else:  # a range per page and span
        src = (base + kw[:, None] * r.width + r.span_off[None, :]).ravel()
        dst = (pw[:, None] * r.pitch + r.lo + r.span_off[None, :]).ravel()
        length = np.broadcast_to(r.span_len[None, :], (len(kw), len(r.span_len))).ravel()
    kp, pp, rp, np_ = k[~whole], page[~whole], row[~whole], rows[~whole]
    lane_src = (
        base + kp[:, None] * r.width + (r.offsets - r.lo)[None, :] + rp[:, None] * r.token_bytes[None, :]
    ).ravel()
    lane_dst = (pp[:, None] * r.pitch + r.offsets[None, :] + rp[:, None] * r.token_bytes[None, :]).ravel()
    lane_len = (np_[:, None] * r.token_bytes[None, :]).ravel()
    src, dst, length = (
        np.concatenate(x).astype(np.int64) for x in ((src, lane_src), (dst, lane_dst), (length, lane_len))
    )
    regions = np.zeros(len(src), dtype=np.int64)
    return Ranges(regions, src, np.full(len(src), r.region, dtype=np.int64), dst, length), zero
