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

import functools
import logging
from dataclasses import dataclass

import numpy as np

from kvpool.geometry import Component
from kvpool.indices import IndexSet
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

    @property
    def num_ranges(self) -> int:
        return len(self.runs) * len(self.src_bufs)

    @property
    def nbytes(self) -> int:
        return int(self.runs.count.sum()) * sum(b.item_bytes for b in self.src_bufs)

    @functools.cached_property
    def ranges(self) -> Ranges:
        """Transport ranges, built on first use: a staged transfer never needs them."""
        return expand(self.runs, list(self.src_bufs), list(self.dst_bufs))

    @property
    def runset(self) -> RunSet:
        """The same ranges factorized (runs x buffer pairs); indices were bounds-checked
        against every buffer when the plan was built."""
        def regions(bufs):
            return np.array([b.region for b in bufs], dtype=np.int64)
        return RunSet(self.runs.src_start, self.runs.dst_start, self.runs.count, regions(self.src_bufs),
                      regions(self.dst_bufs), np.array([b.item_bytes for b in self.src_bufs], dtype=np.int64))


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
