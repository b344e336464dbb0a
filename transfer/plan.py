"""The transfer planner: pure numpy, no per-index Python loops. Per component, the index
work of transfer.runs (align, group into runs contiguous on both sides, check, expand); a
TransferPlan holds the components' plans and the AUX row, validated before a byte moves.

Buffers are numbered regions (transfer.buffers): ranges carry offsets, never addresses; the
link resolves them and checks them again against what each side exposed.

With page-major pools a component has one buffer, so one range per run moves that run's pages
of every layer; layer-major pools multiply the range count by the number of buffers.

Pools of different page sizes move paged components in token rows (transfer.tokens): the
runs are of rows, one range per run and lane (segment); state slots and the AUX row as above.
Between TP shards of different sizes (transfer.reshard) every component moves by lane, a lane
being the slice of a segment's rows this pair owns: one range per row unless it is whole rows.

A receiver holding a prefix of the request (transfer.suffix) gets only the rest: paged
components from its first page (whole pages) or position (by token) it lacks; state whole.
"""

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.geometry import Component
from kvpool.indices import IndexSet
from transfer.buffer_sets import arrays_of, components_of, pair
from transfer.buffers import Buffer
from transfer.errors import IndexMismatch, LayoutIncompatible
from transfer.runs import Runs, align, check_indices, expand, group_runs, segment_runs
from transfer.suffix import Suffix
from transfer.tokens import Lane, SpanRows, Tokens, check_pages, first_covered
from transfer.transports.ranges import LaneRuns, Ranges, RunSet


@dataclass(frozen=True)
class ComponentPlan:
    component: Component
    src_idx: np.ndarray | SpanRows  # int64, aligned (by token, paged: rows worked out where asked)
    dst_idx: np.ndarray | SpanRows
    src_bufs: tuple[Buffer, ...]
    dst_bufs: tuple[Buffer, ...]
    runs: Runs
    field: tuple[int, int] | None = None  # (offset, bytes) of every item that move; None: whole items
    buffer_ids: tuple[int, ...] | None = None  # each buffer's index among the component's (None: 0, 1, ...)
    # pools of different page sizes (transfer.tokens): src_idx / dst_idx / runs are token rows,
    # moved per lane (segment) instead of per buffer; rows [i] hold position first_position + i
    src_lanes: tuple[Lane, ...] | None = None
    dst_lanes: tuple[Lane, ...] | None = None
    first_position: int = 0
    first_item: int = 0  # whole items: src_idx / dst_idx [i] are the aligned arrays' [first_item + i]
    # (a receiver's prefix is left out, transfer.suffix)

    @property
    def by_token(self) -> bool:
        return self.src_lanes is not None

    @property
    def streams(self) -> int:
        """Separate (buffer or lane) streams that move the runs."""
        return len(self.src_lanes) if self.by_token else len(self.src_bufs)

    def buffer_id(self, i: int) -> int:
        """Which of the component's buffers (by token: lanes) stream i is (a layer group holds a subset)."""
        return self.buffer_ids[i] if self.buffer_ids is not None else i

    @property
    def unit_bytes(self) -> tuple[int, ...]:
        """Bytes that move per item (by token: per row) of each stream."""
        if self.by_token:
            return self.lanes.unit_bytes
        return tuple(self.field[1] if self.field else b.item_bytes for b in self.src_bufs)

    @property
    def lanes(self) -> "_LaneArrays":
        """By token: the lane pairing's arrays (built once per pair of lane tuples)."""
        return _lane_arrays(self.component, self.src_lanes, self.dst_lanes)

    @functools.cached_property
    def num_ranges(self) -> int:
        if self.by_token:
            return self.lanes.num_ranges(self.runs)
        items = int(self.runs.count.sum()) if self.field else len(self.runs)
        return items * self.streams

    @functools.cached_property
    def nbytes(self) -> int:  # (asked again when a send reports, after its writes landed)
        return int(self.runs.count.sum()) * sum(self.unit_bytes)

    @functools.cached_property
    def ranges(self) -> Ranges:
        """Transport ranges, built on first use: a staged transfer never needs them."""
        if self.field or self.by_token:
            return self.runset.flatten()
        return expand(self.runs, list(self.src_bufs), list(self.dst_bufs))

    @functools.cached_property
    def runset(self) -> RunSet | LaneRuns:
        """The same ranges factorized (runs x buffer pairs, or x lanes); indices were
        bounds-checked against every buffer when the plan was built. Built once: the mode
        choice, the range count and the link's layout all read it."""
        if self.by_token:
            return _lane_runset(self.runs, self.lanes, self.src_lanes[0].page_size, self.dst_lanes[0].page_size)
        ours, theirs = arrays_of(self.src_bufs), arrays_of(self.dst_bufs)  # (per buffer tuple: once)
        n, field = len(self.src_bufs), self.field
        return RunSet(
            self.runs.src_start,
            self.runs.dst_start,
            self.runs.count,
            ours.region,
            theirs.region,
            ours.item_bytes,
            *((np.full(n, field[0], dtype=np.int64), np.full(n, field[1], dtype=np.int64)) if field else ()),
        )


def _ints(values) -> np.ndarray:
    return np.array(list(values), dtype=np.int64)


def _lane_runset(runs: Runs, a: "_LaneArrays", src_rows: int, dst_rows: int) -> RunSet | LaneRuns:
    """Runs of token rows x lanes. Whole layer-major lanes are rows back to back (a lane is a
    buffer of items of one row: a plain RunSet); others (page-major, TP slices, state slots)
    lie at offsets, pitches and strides that differ per side (LaneRuns, which the link expands)."""
    if a.linear:
        return RunSet(runs.src_start, runs.dst_start, runs.count, a.src_region, a.dst_region, a.row_bytes)
    return LaneRuns(
        runs.src_start,
        runs.dst_start,
        runs.count,
        a.src_offset,
        a.dst_offset,
        a.row_bytes,
        a.src_region,
        a.dst_region,
        a.src_pitch,
        a.dst_pitch,
        a.src_stride,
        a.dst_stride,
        src_rows,
        dst_rows,
    )


@dataclass(frozen=True)
class _LaneArrays:
    """A lane pairing's per-lane numbers as arrays (int64 [n_lanes] each) and what a send
    derives from them alone: what every send to one peer shares (its per-request part, the
    indices, is checked per send: check_pages against src_items / dst_items)."""

    linear: bool
    src_region: np.ndarray
    dst_region: np.ndarray
    row_bytes: np.ndarray
    src_offset: np.ndarray
    dst_offset: np.ndarray
    src_pitch: np.ndarray
    dst_pitch: np.ndarray
    src_stride: np.ndarray
    dst_stride: np.ndarray
    whole: int = 0  # lanes whose rows are back to back on both sides: a run is one range there
    src_items: int = 0  # the fewest items of a source lane's buffer (an index below it is real)
    dst_items: int = 0
    unit_bytes: tuple[int, ...] = ()  # bytes per row of each lane

    def num_ranges(self, runs: Runs) -> int:
        """LaneRuns' range count (one per run of a whole lane, one per row of a sliced one),
        counted from the runs without building them."""
        sliced = len(self.row_bytes) - self.whole
        return len(runs) * self.whole + (int(runs.count.sum()) * sliced if sliced else 0)


_LANE_ARRAYS: dict[tuple[int, int], tuple[tuple, tuple, _LaneArrays]] = {}


def _lane_arrays(c: Component, src: tuple[Lane, ...], dst: tuple[Lane, ...]) -> _LaneArrays:
    """The arrays of a lane pairing, built once per pair of lane tuples (a peer link's lanes
    are the same tuples for every send: transfer.peer.RemotePool): LayoutIncompatible unless
    lane i of `src` moves the bytes per row lane i of `dst` does. Keyed by identity, the tuples
    kept beside so an id is never reused while cached (a pairing that does not pair up is
    never cached); a few hundred pairings at most."""
    key = (id(src), id(dst))
    hit = _LANE_ARRAYS.get(key)
    if hit is not None and hit[0] is src and hit[1] is dst:
        return hit[2]
    if len(src) != len(dst) or any(a.token_bytes != b.token_bytes for a, b in zip(src, dst)):
        raise LayoutIncompatible(f"{c.value}: lanes that do not pair up")
    ints = _ints
    arrays = _LaneArrays(
        all(l.linear for l in src + dst),
        ints(l.region for l in src),
        ints(l.region for l in dst),
        ints(l.token_bytes for l in src),
        ints(l.offset for l in src),
        ints(l.offset for l in dst),
        ints(l.pitch for l in src),
        ints(l.pitch for l in dst),
        ints(l.stride for l in src),
        ints(l.stride for l in dst),
        sum(a.stride == a.token_bytes and b.stride == b.token_bytes for a, b in zip(src, dst)),
        min((l.num_items for l in src), default=0),
        min((l.num_items for l in dst), default=0),
        tuple(l.token_bytes for l in src),
    )
    for f in dataclasses.fields(arrays)[1:10]:
        getattr(arrays, f.name).setflags(write=False)
    if len(_LANE_ARRAYS) >= 512:
        _LANE_ARRAYS.clear()
    _LANE_ARRAYS[key] = (src, dst, arrays)
    return arrays


@dataclass(frozen=True)
class TransferPlan:
    """What moves for one request. `body` goes first; `aux` (the component sent last: the AUX
    row) after it, so its arrival on the receiver means everything else has landed."""

    body: tuple[ComponentPlan, ...]
    aux: ComponentPlan | None

    @property
    def components(self) -> tuple[ComponentPlan, ...]:
        return self.body + ((self.aux,) if self.aux else ())

    @functools.cached_property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.components)

    @property
    def num_ranges(self) -> int:
        return sum(c.num_ranges for c in self.components)

    def body_ranges(self) -> Ranges:
        return Ranges.concat([c.ranges for c in self.body])

    def body_runsets(self) -> list[RunSet | LaneRuns]:
        return [c.runset for c in self.body]


def token_plan(
    c: Component,
    src: np.ndarray,
    dst: np.ndarray,
    src_bufs: list[Buffer],
    dst_bufs: list[Buffer],
    tokens: Tokens,
    *,
    suffix: Suffix | None = None,
) -> ComponentPlan:
    """A component moved by lane (transfer.tokens): a paged one as the positions both sides
    cover (from the receiver's prefix_len on, `suffix`: the receiver may name only the pages
    from it on, a vLLM consumer's blocks of the tokens it lacks), as token rows on each side;
    a state slot (or the AUX row) as one row per index. Rows are grouped into runs."""
    if c not in tokens.src or c not in tokens.dst:
        raise LayoutIncompatible(
            f"{c.value}: no lanes on the {'source' if c not in tokens.src else 'destination'} side"
        )
    src_lanes, dst_lanes = tokens.src[c], tokens.dst[c]
    lanes = _lane_arrays(c, src_lanes, dst_lanes)  # LayoutIncompatible unless they pair up
    if c.per_request:
        s_rows, d_rows = align(src, dst, c)
        check_pages(c, "source", s_rows, lanes.src_items)
        check_pages(c, "destination", d_rows, lanes.dst_items)
        return ComponentPlan(
            c,
            s_rows,
            d_rows,
            tuple(src_bufs),
            tuple(dst_bufs),
            group_runs(s_rows, d_rows, 1, 1),
            src_lanes=src_lanes,
            dst_lanes=dst_lanes,
        )
    n, ps, pd = tokens.num_tokens, src_lanes[0].page_size, dst_lanes[0].page_size
    first_src = first_covered(n, ps, len(src), "source", c)
    first_dst = first_covered(n, pd, len(dst), "destination", c)
    held = suffix.prefix_len if suffix is not None else 0  # the receiver's own: its pages need not be named
    if max(first_src, first_dst) > held and not c.truncatable:
        what = f"all {n} tokens" if not held else f"positions [{held}, {n})"
        raise IndexMismatch(
            f"{c.value}: {len(src)} source pages of {ps} and {len(dst)} destination pages of {pd} must each cover {what}"
        )
    check_pages(c, "source", src, lanes.src_items)
    check_pages(c, "destination", dst, lanes.dst_items)
    first = max(first_src, first_dst)
    if suffix is not None:
        first = suffix.first_position(first)
    s_rows, d_rows = SpanRows.of(src, n, ps, first), SpanRows.of(dst, n, pd, first)
    return ComponentPlan(
        c,
        s_rows,
        d_rows,
        tuple(src_bufs),
        tuple(dst_bufs),
        _row_runs(s_rows, d_rows, not lanes.linear),  # paged: runs end at pages
        src_lanes=src_lanes,
        dst_lanes=dst_lanes,
        first_position=first,
    )


def _row_runs(s: SpanRows, d: SpanRows, paged: bool) -> Runs:
    """The runs of two sides' rows of the same positions. The first position is a multiple
    of the smaller page size (each side's first covered position, or a prefix_len aligned to
    decode's pages) that divides the larger: segment_runs' premise, from the rows where each
    segment starts, O(pages), the rows in between never built (engine blocks of 32 and 48
    tokens: not so, rows grouped one by one)."""
    step, first, n = min(s.page_size, d.page_size), s.first, s.num_tokens
    if first % step or max(s.page_size, d.page_size) % step:
        return group_runs(np.asarray(s), np.asarray(d), *((s.page_size, d.page_size) if paged else ()))
    count = np.full(max(0, -(-(n - first) // step)), step, dtype=np.int64)
    if len(count):  # the last segment ends with the request
        count[-1] = n - first - step * (len(count) - 1)
    return segment_runs(s.starts(step), d.starts(step), count, paged)


def build_plan(
    src_set: IndexSet,
    dst_set: IndexSet,
    src_bufs: Sequence[Buffer],
    dst_bufs: Sequence[Buffer],
    tokens: Tokens | None = None,
    suffix: Suffix | None = None,
) -> TransferPlan:
    """Plan moving every component of `src_set` (local pool) into `dst_set` (the peer's pool).
    With `tokens` (the pools' page sizes differ), paged components move in token rows; between
    TP shards (tokens.sliced) every component moves as the slices of its rows this pair owns.
    With `suffix`, paged components only from the receiver's prefix_len on (transfer.suffix).
    Raises a PlanError, before anything is sent, on any mismatch or out-of-bounds index.
    Tuples of buffers (as KVSender passes them) are grouped and paired once (transfer.buffer_sets);
    every request's indices are checked every time."""
    if suffix is not None and tokens is not None and suffix.num_tokens != tokens.num_tokens:
        raise ValueError(f"a suffix of {suffix.num_tokens} tokens for a request of {tokens.num_tokens}")
    src_by, dst_by = components_of(src_bufs), components_of(dst_bufs)
    # by lane, a component is where its lanes are (an engine's page region holds blocks of its
    # full and sliding-window groups alike: transfer.engine_rows), else where its buffers are
    held_by = tokens.dst if tokens is not None else dst_by
    missing = [c.value for c in src_set.components() if c not in dst_set or (c not in dst_by and c not in held_by)]
    extra = [c.value for c in dst_set.components() if c not in src_set]
    if missing or extra:
        raise LayoutIncompatible(f"component sets differ: destination lacks {missing}, source lacks {extra}")
    body, last = [], []
    for c in src_set.components():
        sb, db = src_by.get(c, ()), dst_by.get(c, ())
        if tokens is not None and tokens.sliced and c not in tokens.src:
            continue  # TP shards: none of this component is this source rank's to send (transfer.reshard)
        if tokens is not None and (tokens.sliced or not c.per_request):
            (last if c.sent_last else body).append(token_plan(c, src_set[c], dst_set[c], sb, db, tokens, suffix=suffix))
            continue
        pair(c, sb, db)
        s_idx, d_idx = align(src_set[c], dst_set[c], c)
        # Indices inside every buffer's item range => every range inside its buffer (expand()
        # checks that again when it builds ranges; the link checks against the regions).
        check_indices(c, "source", s_idx, sb)
        check_indices(c, "destination", d_idx, db)
        k = suffix.first_item(c, len(d_idx)) if suffix is not None else 0  # the receiver's own pages: left out
        s_idx, d_idx = s_idx[k:], d_idx[k:]
        plan = ComponentPlan(c, s_idx, d_idx, sb, db, group_runs(s_idx, d_idx), first_item=k)
        (last if c.sent_last else body).append(plan)
    if len(last) > 1:
        raise LayoutIncompatible(f"more than one component to send last: {[p.component.value for p in last]}")
    return TransferPlan(tuple(body), last[0] if last else None)


def relane(
    plan: TransferPlan, like: IndexSet, dst_set: IndexSet, dst_bufs: Sequence[Buffer], tokens: Tokens
) -> TransferPlan | None:
    """`plan` (by token, into a receiver's indices `like`) for another receiver whose indices
    `dst_set` are the same, with that receiver's lanes and buffers `tokens.dst` / `dst_bufs`:
    the runs are the same (they depend only on both sides' pages and page sizes), so only
    the lanes change. A fan-out (one prefill rank into the decode ranks of a larger TP, whose
    pools allocate alike) plans once, not once per rank. None where the receivers differ in
    anything the runs depend on (indices, page size, components, lane shape): plan it on its
    own. Its indices are still checked against its own buffers (check_pages). Both receivers
    must hold the same prefix (transfer.suffix: the caller's to see; its first position is
    the plan's)."""
    if like.components() != dst_set.components() or not all(_same(like[c], dst_set[c]) for c in like.components()):
        return None
    moved = {c.component for c in plan.components}  # (build_plan's: a sliced pair's own components)
    if not all(c.by_token for c in plan.components) or moved != {
        c for c in like.components() if c in tokens.src or not tokens.sliced
    }:
        return None
    by_c, out = components_of(dst_bufs), []
    for cp in plan.components:
        c = cp.component
        if c not in tokens.src or c not in tokens.dst or c not in by_c:
            return None
        src_lanes, dst_lanes = tokens.src[c], tokens.dst[c]
        lanes = _lane_arrays(c, src_lanes, dst_lanes)  # LayoutIncompatible unless they pair up
        if (
            lanes.linear != cp.lanes.linear
            or getattr(cp.src_idx, "num_tokens", tokens.num_tokens) != tokens.num_tokens
            or src_lanes[0].page_size != cp.src_lanes[0].page_size
            or dst_lanes[0].page_size != cp.dst_lanes[0].page_size
        ):
            return None
        for side, idx, items, checked in (
            ("source", cp.src_idx, lanes.src_items, cp.lanes.src_items),
            ("destination", cp.dst_idx, lanes.dst_items, cp.lanes.dst_items),
        ):
            if items < checked:  # (the same indices passed for at least as many items already)
                check_pages(c, side, idx.pages if isinstance(idx, SpanRows) else idx, items)
        out.append(_with_lanes(cp, by_c[c], src_lanes, dst_lanes))
    return TransferPlan(tuple(out[: len(plan.body)]), out[-1] if plan.aux is not None else None)


def frozen(plan: TransferPlan) -> TransferPlan:
    """`plan` with its runs as read-only arrays of their own: the runsets of every receiver
    relaned from it share them, and LaneRuns checks shared frozen runs once (ranges.py)."""

    def freeze(a: np.ndarray) -> np.ndarray:
        a = np.array(a, dtype=np.int64)  # (a copy: nothing else can write it)
        a.setflags(write=False)
        return a

    def one(cp: ComponentPlan) -> ComponentPlan:
        runs = Runs(freeze(cp.runs.src_start), freeze(cp.runs.dst_start), freeze(cp.runs.count))
        return dataclasses.replace(cp, runs=runs)

    return TransferPlan(tuple(one(c) for c in plan.body), one(plan.aux) if plan.aux is not None else None)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a is b or (a.shape == b.shape and bool((a == b).all()))


def _with_lanes(cp: ComponentPlan, dst_bufs: tuple[Buffer, ...], src_lanes, dst_lanes) -> ComponentPlan:
    """cp with another receiver's buffers and lanes (the rest shared; dataclasses.replace
    took a third of relane's time)."""
    return ComponentPlan(
        cp.component,
        cp.src_idx,
        cp.dst_idx,
        cp.src_bufs,
        dst_bufs,
        cp.runs,
        field=cp.field,
        buffer_ids=cp.buffer_ids,
        src_lanes=src_lanes,
        dst_lanes=dst_lanes,
        first_position=cp.first_position,
        first_item=cp.first_item,
    )
