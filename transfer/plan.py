"""The transfer planner: pure numpy, no per-index Python loops.

    src pages  [5, 6, 7, 20, 21, 9]      align -> same length (per component rules)
    dst pages  [3, 4, 5,  8,  9, 1]      group -> runs contiguous on BOTH sides:
    runs       (5->3, 3)  (20->8, 2)  (9->1, 1)
    expand     runs x buffers -> ranges: addr = ptr + start * item_bytes, len = count * item_bytes
    check      every range inside a buffer of the right side, every index inside its buffer

With page-major pools a component has one buffer, so one range per run moves that run's pages
of every layer; layer-major pools multiply the range count by the number of buffers.
"""

import functools
import logging
from dataclasses import dataclass

import numpy as np

from kvpool.geometry import Component
from kvpool.indices import IndexSet
from kvpool.storage import BufferDescriptor
from transfer.errors import IndexMismatch, LayoutIncompatible, OutOfBounds

log = logging.getLogger(__name__)

# Components whose index arrays may differ in length between the sides (truncated to the
# shorter, with a warning); FULL must match exactly, per-request components hold one index.
TRUNCATABLE = (Component.SWA, Component.NSA)


def align(src: np.ndarray, dst: np.ndarray, component: Component) -> tuple[np.ndarray, np.ndarray]:
    """Equal-length (src, dst) for one component. Never mutates its inputs: the result is new
    read-only arrays. Mismatches FULL/MAMBA/AUX cannot have raise IndexMismatch."""
    if len(src) != len(dst):
        if component not in TRUNCATABLE:
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


@dataclass(frozen=True)
class Ranges:
    src: np.ndarray     # int64 [n] source addresses
    dst: np.ndarray     # int64 [n] destination addresses
    length: np.ndarray  # int64 [n] bytes

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @staticmethod
    def concat(parts: list["Ranges"]) -> "Ranges":
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return Ranges(empty, empty, empty)
        return Ranges(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("src", "dst", "length")))


def pair_buffers(component: Component, src: list[BufferDescriptor], dst: list[BufferDescriptor]) -> None:
    """The two sides' buffers of a component must pair up one to one: same count, and per
    position the same layer, part and item size. Raises LayoutIncompatible naming the first
    difference."""
    if len(src) != len(dst):
        raise LayoutIncompatible(
            f"{component.value}: {len(src)} source buffers vs {len(dst)} destination buffers "
            "(page-major vs layer-major, or a different layer set)")
    for i, (s, d) in enumerate(zip(src, dst)):
        if (s.layer, s.part, s.item_bytes) != (d.layer, d.part, d.item_bytes):
            raise LayoutIncompatible(
                f"{component.value} buffer {i}: source (layer {s.layer}, {s.part}, {s.item_bytes} B/item) vs "
                f"destination (layer {d.layer}, {d.part}, {d.item_bytes} B/item)")


def check_indices(component: Component, side: str, idx: np.ndarray, bufs: list[BufferDescriptor]) -> None:
    """Every index names a real item of every buffer (1 <= i < num_items; 0 is the sentinel)."""
    if len(idx) == 0:
        return
    num_items = min(b.nbytes // b.item_bytes for b in bufs)
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 1 or hi >= num_items:
        raise OutOfBounds(f"{component.value}: {side} index {lo if lo < 1 else hi} outside [1, {num_items - 1}]")


def expand(runs: Runs, src: list[BufferDescriptor], dst: list[BufferDescriptor]) -> Ranges:
    """runs x buffers -> ranges, buffer-major ([buffer 0 runs..., buffer 1 runs..., ...]).
    Each buffer's block of ranges is checked against that buffer's own bounds."""
    src_ptr = np.array([b.ptr for b in src], dtype=np.int64)[:, None]
    dst_ptr = np.array([b.ptr for b in dst], dtype=np.int64)[:, None]
    item = np.array([b.item_bytes for b in src], dtype=np.int64)[:, None]
    src_addr = src_ptr + runs.src_start[None, :] * item   # [n_buffers, n_runs]
    dst_addr = dst_ptr + runs.dst_start[None, :] * item
    length = np.broadcast_to(runs.count[None, :] * item, src_addr.shape)
    if len(runs):
        for side, addr, bufs in (("source", src_addr, src), ("destination", dst_addr, dst)):
            lo = addr.min(axis=1)
            hi = (addr + length).max(axis=1)
            start = np.array([b.ptr for b in bufs], dtype=np.int64)
            end = start + np.array([b.nbytes for b in bufs], dtype=np.int64)
            bad = np.flatnonzero((lo < start) | (hi > end))
            if len(bad):
                b = bufs[int(bad[0])]
                raise OutOfBounds(f"{b.component.value} {side} buffer (layer {b.layer}, {b.part}): "
                                  f"ranges [{int(lo[bad[0]]):#x}, {int(hi[bad[0]]):#x}) exceed it")
    return Ranges(src_addr.ravel(), dst_addr.ravel(), length.ravel())


def check_ranges(side: str, addr: np.ndarray, length: np.ndarray, regions: list[tuple[int, int]]) -> None:
    """Every [addr, addr + length) must lie inside one registered (ptr, nbytes) region."""
    if len(addr) == 0:
        return
    if not regions:
        raise OutOfBounds(f"{side}: no registered buffers")
    order = sorted(regions)
    starts = np.array([p for p, _ in order], dtype=np.int64)
    ends = starts + np.array([n for _, n in order], dtype=np.int64)
    i = np.searchsorted(starts, addr, side="right") - 1
    ok = (i >= 0) & (length > 0)
    ok &= addr + length <= ends[np.maximum(i, 0)]
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise OutOfBounds(f"{side}: range {int(addr[bad]):#x}+{int(length[bad])} lies outside every registered buffer")


@dataclass(frozen=True)
class ComponentPlan:
    component: Component
    src_idx: np.ndarray          # int64, aligned
    dst_idx: np.ndarray          # int64, aligned
    src_bufs: tuple[BufferDescriptor, ...]
    dst_bufs: tuple[BufferDescriptor, ...]
    runs: Runs

    @property
    def num_ranges(self) -> int:
        return len(self.runs) * len(self.src_bufs)

    @property
    def nbytes(self) -> int:
        return int(self.runs.count.sum()) * sum(b.item_bytes for b in self.src_bufs)

    @functools.cached_property
    def ranges(self) -> Ranges:
        """Engine ranges, built on first use: a staged transfer never needs them."""
        return expand(self.runs, list(self.src_bufs), list(self.dst_bufs))


@dataclass(frozen=True)
class TransferPlan:
    """What moves for one request. `body` goes first; `aux` (the AUX row) last, so its
    arrival on the receiver means everything else has landed."""

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


def _by_component(descs: list[BufferDescriptor]) -> dict[Component, list[BufferDescriptor]]:
    out: dict[Component, list[BufferDescriptor]] = {}
    for d in descs:
        out.setdefault(Component(d.component), []).append(d)
    return out


def build_plan(src_set: IndexSet, dst_set: IndexSet, src_descs: list[BufferDescriptor],
               dst_descs: list[BufferDescriptor], local_regions: list[tuple[int, int]] | None = None,
               peer_regions: list[tuple[int, int]] | None = None) -> TransferPlan:
    """Plan moving every component of `src_set` (local pool) into `dst_set` (the peer's pool).
    `*_regions` are the (ptr, nbytes) ranges registered with the engine on each side; every
    buffer must lie inside one. Raises a PlanError, before anything is sent, on any mismatch
    or out-of-bounds index."""
    src_by, dst_by = _by_component(src_descs), _by_component(dst_descs)
    missing = [c.value for c in src_set.components() if c not in dst_set or c not in dst_by]
    extra = [c.value for c in dst_set.components() if c not in src_set]
    if missing or extra:
        raise LayoutIncompatible(f"component sets differ: destination lacks {missing}, source lacks {extra}")
    for side, descs, regions in (("source", src_descs, local_regions), ("destination", dst_descs, peer_regions)):
        if regions is not None:
            check_ranges(f"{side} buffers", np.array([d.ptr for d in descs], dtype=np.int64),
                         np.array([d.nbytes for d in descs], dtype=np.int64), regions)
    body, aux = [], None
    for c in src_set.components():
        sb, db = src_by.get(c, []), dst_by[c]
        pair_buffers(c, sb, db)
        s_idx, d_idx = align(src_set[c], dst_set[c], c)
        # Indices inside every buffer's item range + buffers inside registered regions =>
        # every range inside its buffer (expand() checks that again when it builds ranges).
        check_indices(c, "source", s_idx, sb)
        check_indices(c, "destination", d_idx, db)
        plan = ComponentPlan(c, s_idx, d_idx, tuple(sb), tuple(db), group_runs(s_idx, d_idx))
        if c is Component.AUX:
            aux = plan
        else:
            body.append(plan)
    return TransferPlan(tuple(body), aux)
