"""Index work of the planner, pure numpy (no per-index Python loop): one component's indices
aligned, grouped into runs contiguous on both sides, checked, and expanded into ranges.

    src pages  [5, 6, 7, 20, 21, 9]      align -> same length (per component rules)
    dst pages  [3, 4, 5,  8,  9, 1]      group -> runs contiguous on BOTH sides:
    runs       (5->3, 3)  (20->8, 2)  (9->1, 1)
    expand     runs x buffers -> ranges: (region, start * item_bytes), len = count * item_bytes
    check      every index inside its buffer on both sides (so every range is inside it)
"""

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.geometry import Component
from transfer.buffer_sets import arrays_of
from transfer.buffers import Buffer
from transfer.errors import IndexMismatch, OutOfBounds
from transfer.transports.ranges import Ranges

log = logging.getLogger(__name__)


def align(src: np.ndarray, dst: np.ndarray, component: Component) -> tuple[np.ndarray, np.ndarray]:
    """Equal-length (src, dst) for one component. Never mutates its inputs: the result is new
    read-only arrays. A length mismatch of a component that is not truncatable raises
    IndexMismatch."""
    if len(src) != len(dst):
        if not component.truncatable:
            raise IndexMismatch(
                f"{component.value}: {len(src)} source vs {len(dst)} destination indices must match exactly"
            )
        log.warning(
            "%s: %d source vs %d destination indices; truncating to %d",
            component.value,
            len(src),
            len(dst),
            min(len(src), len(dst)),
        )
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
    count: np.ndarray  # int64 [n_runs], items per run

    def __len__(self) -> int:
        return len(self.count)


_COUNTS = (np.zeros(0, dtype=np.int64), np.ones(1, dtype=np.int64))  # no run; one run of one item
for _a in _COUNTS:
    _a.setflags(write=False)


def group_runs(src: np.ndarray, dst: np.ndarray, src_page: int = 0, dst_page: int = 0) -> Runs:
    """Maximal runs where both src and dst advance by exactly one item. With page sizes
    (token rows of page-major lanes, transfer.tokens: contiguous only within a page) a run
    also ends where a page of either side ends. Every send groups each component's indices:
    a dozen whole-array numpy calls, no wrappers (np.diff, np.append cost more than the work
    at a few hundred pages), and a one-index component (a state slot, the AUX row) none."""
    n = len(src)
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    if n <= 1:
        return Runs(src[:n], dst[:n], _COUNTS[n])
    edge = np.empty(n + 1, dtype=bool)  # edge[i]: a run starts at i (edge[n]: the end)
    edge[0] = edge[n] = True
    inner = edge[1:n]
    np.not_equal(src[1:] - src[:-1], 1, out=inner)
    inner |= dst[1:] - dst[:-1] != 1
    if src_page and dst_page:
        inner |= (src[1:] % src_page == 0) | (dst[1:] % dst_page == 0)
    at = np.flatnonzero(edge)
    starts = at[:-1]
    return Runs(src[starts], dst[starts], at[1:] - starts)


def segment_runs(s: np.ndarray, d: np.ndarray, count: np.ndarray, paged: bool) -> Runs:
    """group_runs of token rows of consecutive positions from a multiple of `step` (the
    smaller of two power-of-two page sizes), in O(rows / step), from the rows `s`, `d` where
    each segment of `step` positions starts and each segment's rows `count` (`step`, the last
    maybe fewer): rows of `step` positions from such a multiple lie in one page on each side,
    so every segment is one run, and a page of either side starts at every segment's first
    row. `paged` (runs end at pages: what group_runs(src, dst, ps, pd) gives): the segments;
    else maximal runs of them (what group_runs(src, dst) gives).

        positions  first ... |<- step ->|<- step ->|<- step ->| ... n
        runs                   one        one        one          (paged)
                               one ................. one          (not paged: merged where
                                                                   both sides continue)"""
    if paged or len(s) < 2:
        return Runs(s, d, count)
    keep = np.concatenate(([0], np.flatnonzero((s[1:] != s[:-1] + count[:-1]) | (d[1:] != d[:-1] + count[:-1])) + 1))
    return Runs(s[keep], d[keep], np.add.reduceat(count, keep))


def check_indices(component: Component, side: str, idx: np.ndarray, bufs: Sequence[Buffer]) -> None:
    """Every index names a real item of every buffer (1 <= i < num_items; 0 is the sentinel)."""
    if len(idx) == 0:
        return
    num_items = arrays_of(tuple(bufs)).num_items
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 1 or hi >= num_items:
        raise OutOfBounds(f"{component.value}: {side} index {lo if lo < 1 else hi} outside [1, {num_items - 1}]")


def expand(runs: Runs, src: list[Buffer], dst: list[Buffer]) -> Ranges:
    """runs x buffers -> ranges, buffer-major ([buffer 0 runs..., buffer 1 runs..., ...]).
    Each buffer's block of ranges is checked against that buffer's own size."""
    n_runs = len(runs)
    item = np.array([b.item_bytes for b in src], dtype=np.int64)[:, None]
    src_off = runs.src_start[None, :] * item  # [n_buffers, n_runs]
    dst_off = runs.dst_start[None, :] * item
    length = np.broadcast_to(runs.count[None, :] * item, src_off.shape)
    if n_runs:
        for side, off, bufs in (("source", src_off, src), ("destination", dst_off, dst)):
            hi = (off + length).max(axis=1)
            bad = np.flatnonzero((off.min(axis=1) < 0) | (hi > np.array([b.nbytes for b in bufs], dtype=np.int64)))
            if len(bad):
                b = bufs[int(bad[0])]
                raise OutOfBounds(
                    f"{Component(b.component).value} {side} buffer (layer {b.layer}, {b.part}): "
                    f"ranges up to byte {int(hi[bad[0]])} exceed its {b.nbytes}"
                )
    src_region = np.repeat(np.array([b.region for b in src], dtype=np.int64), n_runs)
    dst_region = np.repeat(np.array([b.region for b in dst], dtype=np.int64), n_runs)
    return Ranges(src_region, src_off.ravel(), dst_region, dst_off.ravel(), length.ravel())
