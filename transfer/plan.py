"""The transfer planner: pure numpy, no per-index Python loops.

    src pages  [5, 6, 7, 20, 21, 9]      align -> same length (per component rules)
    dst pages  [3, 4, 5,  8,  9, 1]      group -> runs contiguous on BOTH sides:
    runs       (5->3, 3)  (20->8, 2)  (9->1, 1)
    expand     runs x buffers -> ranges: (region, start * item_bytes), len = count * item_bytes
    check      every index inside its buffer on both sides (so every range is inside it)

Buffers are numbered regions (transfer.buffers): ranges carry offsets, never addresses; the
link resolves them and checks them again against what each side exposed.

With page-major pools a component has one buffer, so one range per run moves that run's pages
of every layer; layer-major pools multiply the range count by the number of buffers.
"""

import dataclasses
import functools
import logging
from dataclasses import dataclass

import numpy as np

from kvpool.geometry import Component
from kvpool.indices import IndexSet
from kvpool.layout import ALIGN
from transfer.buffers import Buffer, by_component, component_difference
from transfer.errors import IndexMismatch, LayoutIncompatible, OutOfBounds
from transfer.transports.base import Ranges, RunSet

log = logging.getLogger(__name__)


def align(src: np.ndarray, dst: np.ndarray, component: Component) -> tuple[np.ndarray, np.ndarray]:
    """Equal-length (src, dst) for one component. Never mutates its inputs: the result is new
    read-only arrays. A length mismatch of a component that is not truncatable raises
    IndexMismatch."""
    if len(src) != len(dst):
        if not component.truncatable:
            raise IndexMismatch(
                f"{component.value}: {len(src)} source vs {len(dst)} destination indices must match exactly")
        log.warning("%s: %d source vs %d destination indices; truncating to %d",
                    component.value, len(src), len(dst), min(len(src), len(dst)))
    n = min(len(src), len(dst))
    out_src = np.array(src[:n], dtype=np.int64)
    out_dst = np.array(dst[:n], dtype=np.int64)
    out_src.setflags(write=False)
    out_dst.setflags(write=False)
    return out_src, out_dst


@dataclass(frozen=True)
class Runs:
    src_start: np.ndarray  # int64 [n_runs]
    dst_start: np.ndarray  # int64 [n_runs]
    count: np.ndarray      # int64 [n_runs], items per run

    def __len__(self) -> int:
        return len(self.count)


def group_runs(src: np.ndarray, dst: np.ndarray) -> Runs:
    """Maximal runs where both src and dst advance by exactly one item."""
    n = len(src)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Runs(empty, empty, empty)
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    count = np.diff(np.append(starts, n))
    return Runs(src[starts], dst[starts], count)


def pair_buffers(component: Component, src: list[Buffer], dst: list[Buffer]) -> None:
    """Raises LayoutIncompatible naming the first difference (transfer.buffers' one check)."""
    diff = component_difference(component, src, dst)
    if diff:
        raise LayoutIncompatible(diff)


def check_indices(component: Component, side: str, idx: np.ndarray, bufs: list[Buffer]) -> None:
    """Every index names a real item of every buffer (1 <= i < num_items; 0 is the sentinel)."""
    if len(idx) == 0:
        return
    num_items = min(b.num_items for b in bufs)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 1 or hi >= num_items:
        raise OutOfBounds(f"{component.value}: {side} index {lo if lo < 1 else hi} outside [1, {num_items - 1}]")


def expand(runs: Runs, src: list[Buffer], dst: list[Buffer]) -> Ranges:
    """runs x buffers -> ranges, buffer-major ([buffer 0 runs..., buffer 1 runs..., ...]).
    Each buffer's block of ranges is checked against that buffer's own size."""
    n_runs = len(runs)
    item = np.array([b.item_bytes for b in src], dtype=np.int64)[:, None]
    src_off = runs.src_start[None, :] * item   # [n_buffers, n_runs]
    dst_off = runs.dst_start[None, :] * item
    length = np.broadcast_to(runs.count[None, :] * item, src_off.shape)
    if n_runs:
        for side, off, bufs in (("source", src_off, src), ("destination", dst_off, dst)):
            hi = (off + length).max(axis=1)
            bad = np.flatnonzero((off.min(axis=1) < 0) | (hi > np.array([b.nbytes for b in bufs], dtype=np.int64)))
            if len(bad):
                b = bufs[int(bad[0])]
                raise OutOfBounds(f"{Component(b.component).value} {side} buffer (layer {b.layer}, {b.part}): "
                                  f"ranges up to byte {int(hi[bad[0]])} exceed its {b.nbytes}")
    src_region = np.repeat(np.array([b.region for b in src], dtype=np.int64), n_runs)
    dst_region = np.repeat(np.array([b.region for b in dst], dtype=np.int64), n_runs)
    return Ranges(src_region, src_off.ravel(), dst_region, dst_off.ravel(), length.ravel())


@dataclass(frozen=True)
class ComponentPlan:
    component: Component
    src_idx: np.ndarray          # int64, aligned
    dst_idx: np.ndarray          # int64, aligned
    src_bufs: tuple[Buffer, ...]
    dst_bufs: tuple[Buffer, ...]
    runs: Runs
    field: tuple[int, int] | None = None   # (offset, bytes) of every item that move; None: whole items
    buffer_ids: tuple[int, ...] | None = None   # each buffer's index among the component's (None: 0, 1, ...)

    def buffer_id(self, i: int) -> int:
        """Which of the component's buffers src_bufs[i] / dst_bufs[i] are (a layer group holds a subset)."""
        return self.buffer_ids[i] if self.buffer_ids is not None else i

    @property
    def unit_bytes(self) -> tuple[int, ...]:
        """Bytes that move per item of each buffer."""
        return tuple(self.field[1] if self.field else b.item_bytes for b in self.src_bufs)

    @property
    def num_ranges(self) -> int:
        items = int(self.runs.count.sum()) if self.field else len(self.runs)
        return items * len(self.src_bufs)

    @property
    def nbytes(self) -> int:
        return int(self.runs.count.sum()) * sum(self.unit_bytes)

    @functools.cached_property
    def ranges(self) -> Ranges:
        """Transport ranges, built on first use: a staged transfer never needs them."""
        if self.field:
            return self.runset.flatten()
        return expand(self.runs, list(self.src_bufs), list(self.dst_bufs))

    @property
    def runset(self) -> RunSet:
        """The same ranges factorized (runs x buffer pairs); indices were bounds-checked
        against every buffer when the plan was built."""
        def ints(values):
            return np.array(list(values), dtype=np.int64)
        field = (ints(self.field[0] for _ in self.src_bufs), ints(self.field[1] for _ in self.src_bufs)) \
            if self.field else (None, None)
        return RunSet(self.runs.src_start, self.runs.dst_start, self.runs.count, ints(b.region for b in self.src_bufs),
                      ints(b.region for b in self.dst_bufs), ints(b.item_bytes for b in self.src_bufs), *field)


@dataclass(frozen=True)
class TransferPlan:
    """What moves for one request. `body` goes first; `aux` (the component sent last: the AUX
    row) after it, so its arrival on the receiver means everything else has landed."""

    body: tuple[ComponentPlan, ...]
    aux: ComponentPlan | None

    @property
    def components(self) -> tuple[ComponentPlan, ...]:
        return self.body + ((self.aux,) if self.aux else ())

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.components)

    @property
    def num_ranges(self) -> int:
        return sum(c.num_ranges for c in self.components)

    def body_ranges(self) -> Ranges:
        return Ranges.concat([c.ranges for c in self.body])

    def body_runsets(self) -> list[RunSet]:
        return [c.runset for c in self.body]


def build_plan(src_set: IndexSet, dst_set: IndexSet, src_bufs: list[Buffer], dst_bufs: list[Buffer]) -> TransferPlan:
    """Plan moving every component of `src_set` (local pool) into `dst_set` (the peer's pool).
    Raises a PlanError, before anything is sent, on any mismatch or out-of-bounds index."""
    src_by, dst_by = by_component(src_bufs), by_component(dst_bufs)
    missing = [c.value for c in src_set.components() if c not in dst_set or c not in dst_by]
    extra = [c.value for c in dst_set.components() if c not in src_set]
    if missing or extra:
        raise LayoutIncompatible(f"component sets differ: destination lacks {missing}, source lacks {extra}")
    body, last = [], []
    for c in src_set.components():
        sb, db = src_by.get(c, []), dst_by[c]
        pair_buffers(c, sb, db)
        s_idx, d_idx = align(src_set[c], dst_set[c], c)
        # Indices inside every buffer's item range => every range inside its buffer (expand()
        # checks that again when it builds ranges; the link checks against the regions).
        check_indices(c, "source", s_idx, sb)
        check_indices(c, "destination", d_idx, db)
        plan = ComponentPlan(c, s_idx, d_idx, tuple(sb), tuple(db), group_runs(s_idx, d_idx))
        (last if c.sent_last else body).append(plan)
    if len(last) > 1:
        raise LayoutIncompatible(f"more than one component to send last: {[p.component.value for p in last]}")
    return TransferPlan(tuple(body), last[0] if last else None)


# ---- layer groups: a plan cut by model layer, for layer-wise streaming ---------------------
#
#   model layers   0 1 2 3 | 4 5 6 7 | 8 9 10 11        bounds [0, 4, 8, 12]: three groups
#   layer-major    group g = the buffers whose layer is in g (whole items)
#   page-major     group g = the bytes of each row that hold g's layers (a field):
#                  | L0.k L0.v ... L3.v | L4.k ... L7.v | L8.k ... L11.v |   one fragment per
#                  |<--- group 0 ------>|<-- group 1 -->|<-- group 2 --->|   row and group

Placement = tuple[int, int, int, int]   # (buffer, layer, byte offset in the item, bytes)


@dataclass(frozen=True)
class LayerGroup:
    layers: range                      # the model layers whose KV (and state) this part carries
    body: tuple[ComponentPlan, ...]    # may be empty: no component has a layer in it

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.body)


def _spans(placements: list[Placement], align: int, item_bytes: int) -> list[tuple[int, int]]:
    """Contiguous byte spans covering these placements of one buffer, each taking the
    alignment padding after it along: the groups' spans tile the item, padding included, so a
    streamed row arrives byte for byte as a whole one would."""
    spans: list[list[int]] = []
    for _, _, off, n in sorted(placements, key=lambda p: p[2]):
        end = min(-(-(off + n) // align) * align, item_bytes)
        if spans and off <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([off, end])
    return [(a, b - a) for a, b in spans]


def split_layers(plan: TransferPlan, bounds: list[int], placements: dict[Component, list[Placement]],
                 align: int = ALIGN) -> list[LayerGroup]:
    """The plan's body as consecutive layer groups [bounds[g], bounds[g + 1]): every byte the
    plan moves for a layer lands in exactly one group. `placements` are where each layer's
    segments lie in the sender's items (a buffer that pairs up has the same on the receiver).
    The AUX row belongs to no group: it still goes last."""
    if len(bounds) < 2 or any(b >= a for a, b in zip(bounds[1:], bounds)):
        raise ValueError(f"layer group bounds must increase: {bounds}")
    layers_sent = {b.layer for cp in plan.body for b in cp.src_bufs if b.layer is not None} | \
        {p[1] for cp in plan.body if any(b.layer is None for b in cp.src_bufs) for p in placements.get(cp.component, [])}
    outside = sorted(l for l in layers_sent if not bounds[0] <= l < bounds[-1])
    if outside:
        raise ValueError(f"layer groups {bounds[0]}..{bounds[-1] - 1} leave out layers {outside}")
    groups = [range(a, b) for a, b in zip(bounds, bounds[1:])]
    parts: list[list[ComponentPlan]] = [[] for _ in groups]
    for cp in plan.body:
        whole = {bi: b.item_bytes for bi, b in enumerate(cp.src_bufs)}
        for g, layers in enumerate(groups):
            if all(b.layer is not None for b in cp.src_bufs):        # layer-major: whole buffers
                keep = [i for i, b in enumerate(cp.src_bufs) if b.layer in layers]
                if keep:
                    parts[g].append(dataclasses.replace(cp, src_bufs=tuple(cp.src_bufs[i] for i in keep),
                                                        dst_bufs=tuple(cp.dst_bufs[i] for i in keep),
                                                        buffer_ids=tuple(cp.buffer_id(i) for i in keep)))
                continue
            for bi in range(len(cp.src_bufs)):                         # page-major: a field of each row
                mine = [p for p in placements.get(cp.component, []) if p[0] == bi and p[1] in layers]
                for off, n in _spans(mine, align, whole[bi]):
                    field = None if (off, n) == (0, whole[bi]) else (off, n)
                    parts[g].append(dataclasses.replace(cp, src_bufs=(cp.src_bufs[bi],), dst_bufs=(cp.dst_bufs[bi],),
                                                        field=field, buffer_ids=(cp.buffer_id(bi),)))
    return [LayerGroup(layers, tuple(p)) for layers, p in zip(groups, parts)]
