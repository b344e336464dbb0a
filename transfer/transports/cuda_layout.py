"""The host side of a cuda-ipc write, pure numpy (no GPU needed, so tests run it anywhere):
runsets checked against the regions both sides exposed, laid out as one kernel table and its
launches, and the key that finds a layout prepared before.

    runsets (per group: a body, then its AUX row)
      -> layout_key: their runs, buffers and lanes as one int64 vector (the link's table
         cache looks it up: the same pages and peer again start from the table on the GPU,
         with nothing below done again)
      -> Regions.work: every range inside its region on both sides, checked in O(runs) per
         set against what the buffer arrays allow (worked out once per array: the planner
         passes the same arrays for every send to one peer, transfer.buffer_sets)
      -> lay_out: the table's values and launches (cuda_copy.py draws the table)

Why a key of the runsets and not of the table: the table is what this module computes (a few
long ranges cut into 256 KiB pieces, or runs x buffers); hashing it meant computing it first,
and hashing every byte of it (0.8 MB at 32k tokens of page 1). Equal keys are equal runsets
for this link (its regions fixed), so their checks and layout are equal too: a hit skips them.
"""

from dataclasses import dataclass

import numpy as np

from transfer.errors import OutOfBounds
from transfer.transports.ranges import LANE_FIELDS, LaneRuns, Ranges, RunSet, check_ranges

PIECE_BYTES = 256 << 10  # longer ranges are split so warps share the work evenly
HOST_EXPAND = 1 << 12  # up to this many ranges are expanded on the host (numpy), more on the GPU
_SMALL_KEY = 1 << 13  # key vectors up to this many values are keyed by their bytes; longer ones
# by a weighted sum, checked value by value on a hit (hashing 0.8 MB of bytes took ~0.2 ms)
_LANE_FIELDS = ("src_start", "dst_start", "count", *LANE_FIELDS)
_RUN_FIELDS = ("src_start", "dst_start", "count", "src_region", "dst_region", "item_bytes")
_weights = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True)
class LayoutKey:
    """What a layout is looked up by: `digest` (hashable); `values`, for a long key, the
    vector itself, compared on a hit (two vectors may share a digest)."""

    digest: object
    values: np.ndarray | None

    def matches(self, other: "LayoutKey") -> bool:
        return self.values is None or np.array_equal(self.values, other.values)


def layout_key(groups, absolute: bool = False) -> LayoutKey:
    """The key of groups of runsets (`absolute`: RunSets of absolute addresses, Regions.absolute)."""
    head, arrays = [len(groups), int(absolute)], []
    for group in groups:
        head.append(len(group))
        for rs in group:
            if isinstance(rs, LaneRuns):
                head += (1, len(rs.count), len(rs.row_bytes), rs.src_rows, rs.dst_rows)
                arrays += [getattr(rs, f) for f in _LANE_FIELDS]
            else:
                head += (2 if rs.fielded else 0, len(rs.count), len(rs.item_bytes))
                arrays += [getattr(rs, f) for f in _RUN_FIELDS]
                if rs.fielded:
                    arrays += [rs.field_off, rs.field_len]
    values = np.concatenate([np.array(head, dtype=np.int64), *arrays], dtype=np.int64)
    if len(values) <= _SMALL_KEY:
        return LayoutKey(values.tobytes(), None)
    return LayoutKey((len(values), int(np.dot(values, _weights_for(len(values))))), values)


def _weights_for(n: int) -> np.ndarray:
    """Fixed odd random weights (int64, products wrap), at least n of them."""
    global _weights
    if len(_weights) < n:
        w = np.random.default_rng(41).integers(1, 1 << 62, size=max(n, 2 * len(_weights)), dtype=np.int64)
        _weights = w | 1
    return _weights[:n]


class Regions:
    """One side of a link: its regions' addresses and sizes as this process sees them, and
    per buffer (or lane) array the planner passes, each buffer's address and how many items
    (pages) fit in every one of them (looked up by the arrays' identity)."""

    def __init__(self, side: str, bases: np.ndarray, sizes: np.ndarray):
        self.side, self.bases, self.sizes = side, bases, sizes
        self._resolved: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray, int]] = {}

    def resolve(self, region: np.ndarray, unit: np.ndarray) -> tuple[np.ndarray, int]:
        """(each buffer's address, the items of `unit` bytes every buffer holds); OutOfBounds
        for a region that is not one."""
        key = (id(region), id(unit))
        hit = self._resolved.get(key)
        if hit is not None and hit[0] is region and hit[1] is unit:
            return hit[2], hit[3]
        if ((region < 0) | (region >= len(self.sizes))).any():
            raise OutOfBounds(f"cuda-ipc: {self.side} ranges lie outside the {len(self.sizes)} exposed regions")
        bases, fit = self.bases[region], int((self.sizes[region] // unit).min())
        if not region.flags.writeable and not unit.flags.writeable:  # (a plan's: the same every send)
            if len(self._resolved) >= 256:
                self._resolved.clear()
            self._resolved[key] = (region, unit, bases, fit)
        return bases, fit

    def absolute(self, region: np.ndarray, off: np.ndarray, length: np.ndarray) -> np.ndarray:
        check_ranges(self.side, region, off, length, self.sizes)
        return self.bases[region] + off


def work(runsets, src: Regions, dst: Regions) -> list:
    """Runsets as kernel work, every range checked against both sides' regions: a RunSet of
    whole items (or LaneRuns) as itself with each buffer's (lane's) address on each side,
    checked in O(runs); one of fields flat (one fragment per item)."""
    out = []
    for rs in runsets:
        if not len(rs.count):
            continue
        if isinstance(rs, RunSet) and rs.fielded:
            out.append(absolute(rs.flatten(), src, dst))
            continue
        if isinstance(rs, LaneRuns):  # (it refused negative rows itself); a run's last page
            ends = ((rs.src_start + rs.count - 1) // rs.src_rows, (rs.dst_start + rs.count - 1) // rs.dst_rows)
            units, low = (rs.src_pitch, rs.dst_pitch), 0
        else:
            ends, units = (rs.src_start + rs.count - 1, rs.dst_start + rs.count - 1), (rs.item_bytes, rs.item_bytes)
            low = min(int(rs.src_start.min()), int(rs.dst_start.min()), int(rs.count.min()) - 1)
        bases = []
        for side, region, end, unit in (
            (src, rs.src_region, ends[0], units[0]),
            (dst, rs.dst_region, ends[1], units[1]),
        ):
            at, fit = side.resolve(region, unit)
            if low < 0 or int(end.max()) >= fit:
                raise OutOfBounds(f"cuda-ipc: {side.side} ranges lie outside the {len(side.sizes)} exposed regions")
            bases.append(at)
        out.append((rs, *bases))
    return out


def absolute(ranges: Ranges, src: Regions, dst: Regions) -> tuple:
    """Flat ranges as kernel work: checked, then absolute addresses as items of one byte."""
    zero, one = np.zeros(1, dtype=np.int64), np.ones(1, dtype=np.int64)
    s = src.absolute(ranges.src_region, ranges.src_off, ranges.length)
    d = dst.absolute(ranges.dst_region, ranges.dst_off, ranges.length)
    return RunSet(s, d, ranges.length, zero, zero, one), zero, zero


@dataclass(frozen=True)
class Layout:
    """A chain's kernel table (int64 values) and its launches: (kernel, rows, pointer
    arguments in words from the table's start, other arguments), in launch order."""

    values: np.ndarray
    launches: list[tuple]
    nbytes: int


def lay_out(groups) -> Layout:
    """Groups of work (work()) as one table, each group's launches after the previous group's
    (a body, then its AUX row)."""
    parts, launches, total, at = [], [], 0, 0
    for group in groups:
        values, specs, nbytes = _layout(group)
        launches += [(name, rows, tuple(at + p for p in ptrs), ints) for name, rows, ptrs, ints in specs]
        parts.append(values)
        at, total = at + len(values), total + nbytes
    values = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, dtype=np.int64)
    return Layout(values.astype(np.int64, copy=False), launches, total)


def _flat(rs: RunSet, src_base: np.ndarray, dst_base: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if len(rs.item_bytes) == 1:  # one buffer (page-major, an AUX row): plain vectors
        item = int(rs.item_bytes[0])
        return src_base[0] + rs.src_start * item, dst_base[0] + rs.dst_start * item, rs.count * item
    item = rs.item_bytes[:, None]
    src = (src_base[:, None] + rs.src_start[None, :] * item).ravel()
    dst = (dst_base[:, None] + rs.dst_start[None, :] * item).ravel()
    return src, dst, np.broadcast_to(rs.count[None, :] * item, (len(rs.item_bytes), len(rs.count))).ravel()


def _split(rs: RunSet, src_base: np.ndarray, dst_base: np.ndarray, longest: int | None = None) -> np.ndarray:
    """Flat [3, n] (src, dst, len) of a run set on the host, ranges cut into pieces of at most
    PIECE_BYTES so the warps share long ones (`longest`: the longest range, where known)."""
    src, dst, length = _flat(rs, src_base, dst_base)
    longest = int(length.max()) if longest is None and len(length) else longest or 0
    if longest <= PIECE_BYTES:  # nothing to cut (an AUX row, fragments)
        return np.concatenate([src, dst, length])
    if int(length.min()) == longest:  # all of one length (single pages): k pieces each
        k = -(-longest // PIECE_BYTES)
        off = np.arange(k, dtype=np.int64) * PIECE_BYTES
        cut = np.minimum(longest - off, PIECE_BYTES)
        n = len(length)
        return np.concatenate([(src[:, None] + off).ravel(), (dst[:, None] + off).ravel(), np.tile(cut, n)])
    pieces = -(-length // PIECE_BYTES)
    which = np.repeat(np.arange(len(length)), pieces)
    off = (np.arange(len(which)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * PIECE_BYTES
    return np.concatenate([src[which] + off, dst[which] + off, np.minimum(length[which] - off, PIECE_BYTES)])


def _layout(work) -> tuple[np.ndarray, list[tuple], int]:
    """One group's table values (int64), its launches as (kernel, rows, pointer arguments in
    words from the values' start, other arguments), and its bytes. A fragmented set (many
    short ranges) crosses as runs + buffers and the kernel expands it; a set of few ranges is
    expanded here and split so the warps share long ones: one launch per fragmented set and
    one for all expanded ranges."""
    total, tables, lanes, flats = 0, [], [], []  # factorized (values, n, b); host-expanded [3, k] pieces
    for rs, src_base, dst_base in work:
        if not len(rs.count):
            continue
        total += rs.nbytes
        if isinstance(rs, LaneRuns):  # src_base / dst_base: each lane's buffer address
            lanes.append(
                (_lane_values(rs, src_base, dst_base), len(rs.count), len(rs.row_bytes), rs.src_rows, rs.dst_rows)
            )
            continue
        longest = int(rs.count.max()) * int(rs.item_bytes.max())
        if longest <= PIECE_BYTES and len(rs) > HOST_EXPAND:
            tables.append(
                (
                    np.concatenate([rs.src_start, rs.dst_start, rs.count, src_base, dst_base, rs.item_bytes]),
                    len(rs.count),
                    len(rs.item_bytes),
                )
            )
        else:
            flats.append(_split(rs, src_base, dst_base, longest if len(rs.item_bytes) == 1 else None).reshape(3, -1))
    flat = (np.concatenate(flats, axis=1) if len(flats) > 1 else flats[0]).ravel() if flats else None
    specs, at = [], 0 if flat is None else len(flat)
    if flat is not None:
        k = len(flat) // 3
        specs.append(("copy_ranges", k, (0, k, 2 * k), (k,)))
    for name, sets in (("copy_runs", tables), ("copy_lanes", lanes)):
        for values, n, b, *rows in sets:
            specs.append((name, n * b, (at,), (n, b, *rows)))
            at += len(values)
    parts = ([] if flat is None else [flat]) + [t[0] for t in tables + lanes]
    values = np.concatenate(parts) if len(parts) > 1 else parts[0] if parts else np.zeros(0, dtype=np.int64)
    return values.astype(np.int64, copy=False), specs, total


def _lane_values(rs: LaneRuns, src_base: np.ndarray, dst_base: np.ndarray) -> np.ndarray:
    return np.concatenate(
        [
            rs.src_start,
            rs.dst_start,
            rs.count,
            src_base,
            rs.src_pitch,
            rs.src_offset,
            rs.src_stride,
            dst_base,
            rs.dst_pitch,
            rs.dst_offset,
            rs.dst_stride,
            rs.row_bytes,
        ]
    )
