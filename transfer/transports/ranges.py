"""Byte ranges as a transport writes them: flat (Ranges), or factorized as the planner
produces them (RunSet: runs x buffer pairs; LaneRuns: runs of token rows x lanes between
pools of different page sizes or TP shards). Offsets into numbered regions, never addresses."""

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from transfer.errors import OutOfBounds


@dataclass(frozen=True)
class Ranges:
    """Byte ranges to write, vectorized: range i copies length[i] bytes from local region
    src_region[i] at src_off[i] to peer region dst_region[i] at dst_off[i]."""

    src_region: np.ndarray  # int64 [n]
    src_off: np.ndarray  # int64 [n]
    dst_region: np.ndarray  # int64 [n]
    dst_off: np.ndarray  # int64 [n]
    length: np.ndarray  # int64 [n] bytes

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum()) if len(self.length) else 0

    @staticmethod
    def one(src_region: int, src_off: int, dst_region: int, dst_off: int, length: int) -> "Ranges":
        return Ranges(*(np.array([v], dtype=np.int64) for v in (src_region, src_off, dst_region, dst_off, length)))

    @staticmethod
    def concat(parts: Sequence["Ranges"]) -> "Ranges":
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return Ranges(empty, empty, empty, empty, empty)
        return Ranges(
            *(
                np.concatenate([getattr(p, f) for p in parts])
                for f in ("src_region", "src_off", "dst_region", "dst_off", "length")
            )
        )


@dataclass(frozen=True)
class RunSet:
    """Ranges factorized as the planner produces them: every run copied once per buffer pair.
    Range (b, r) copies count[r] * item_bytes[b] bytes from local region src_region[b] at
    src_start[r] * item_bytes[b] to peer region dst_region[b] at dst_start[r] * item_bytes[b].
    A layer-major page-1 request is millions of ranges but only runs + buffers here.

    With a field (one layer group of a page-major row, for layer-wise streaming) only bytes
    [field_off[b], field_off[b] + field_len[b]) of each item move, so a run of count items is
    count fragments, one per item:

        item:   |<-------------- item_bytes[b] -------------->|
                | L0.k | L0.v | L1.k | L1.v | L2.k | L2.v | ... |
                       |<- field_len ->|
                field_off
    """

    src_start: np.ndarray  # int64 [n_runs] items
    dst_start: np.ndarray  # int64 [n_runs] items
    count: np.ndarray  # int64 [n_runs] items
    src_region: np.ndarray  # int64 [n_bufs]
    dst_region: np.ndarray  # int64 [n_bufs]
    item_bytes: np.ndarray  # int64 [n_bufs]: the item pitch of each buffer (both sides)
    field_off: np.ndarray | None = None  # int64 [n_bufs]: bytes into each item (None: whole items)
    field_len: np.ndarray | None = None  # int64 [n_bufs]: bytes of each item that move

    def __post_init__(self) -> None:
        if (self.field_off is None) != (self.field_len is None):
            raise ValueError("a field needs both its offset and its length")
        if (
            self.fielded
            and (
                (self.field_off < 0) | (self.field_len <= 0) | (self.field_off + self.field_len > self.item_bytes)
            ).any()
        ):
            raise OutOfBounds("a field lies outside its item")

    @property
    def fielded(self) -> bool:
        return self.field_off is not None

    def __len__(self) -> int:
        """Separate byte ranges (a field makes one per item)."""
        if self.fielded:
            return int(self.count.sum()) * len(self.item_bytes)
        return len(self.count) * len(self.item_bytes)

    @property
    def nbytes(self) -> int:
        per_item = self.field_len if self.fielded else self.item_bytes
        return int(self.count.sum()) * int(per_item.sum())

    def items(self) -> "RunSet":
        """The same bytes with every run cut into runs of one item (what a field copies)."""
        n = int(self.count.sum())
        first = np.repeat(np.cumsum(self.count) - self.count, self.count)
        step = np.arange(n, dtype=np.int64) - first
        return RunSet(
            np.repeat(self.src_start, self.count) + step,
            np.repeat(self.dst_start, self.count) + step,
            np.ones(n, dtype=np.int64),
            self.src_region,
            self.dst_region,
            self.item_bytes,
            self.field_off,
            self.field_len,
        )

    def flatten(self) -> "Ranges":
        """Buffer-major flat ranges ([buffer 0 runs..., buffer 1 runs..., ...])."""
        rs = self.items() if self.fielded else self
        n, item = len(rs.count), rs.item_bytes[:, None]
        off = rs.field_off[:, None] if rs.fielded else np.zeros_like(item)
        unit = rs.field_len[:, None] if rs.fielded else item
        length = np.broadcast_to(rs.count[None, :] * unit, (len(rs.item_bytes), n))
        return Ranges(
            np.repeat(rs.src_region, n),
            (rs.src_start[None, :] * item + off).ravel(),
            np.repeat(rs.dst_region, n),
            (rs.dst_start[None, :] * item + off).ravel(),
            length.ravel(),
        )

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        """Per buffer pair, the end of the furthest range on each side (bytes): bounds in O(runs)."""
        if not len(self.count):
            zero = np.zeros(len(self.item_bytes), dtype=np.int64)
            return zero, zero
        # a field ends inside the last item: at most the item's end, which is what is returned
        return (
            (self.src_start + self.count).max() * self.item_bytes,
            (self.dst_start + self.count).max() * self.item_bytes,
        )


def check_ranges(side: str, region: np.ndarray, off: np.ndarray, length: np.ndarray, sizes: np.ndarray) -> None:
    """Every [off, off + length) lies inside region `region` of a table of `sizes` (vectorized)."""
    if len(length) == 0:
        return
    if len(sizes) == 0:
        raise OutOfBounds(f"{side}: no exposed regions")
    ok = (region >= 0) & (region < len(sizes)) & (off >= 0) & (length > 0)
    ok &= off + length <= sizes[np.clip(region, 0, len(sizes) - 1)]
    if not ok.all():
        i = int(np.flatnonzero(~ok)[0])
        raise OutOfBounds(
            f"{side}: range of {int(length[i])} bytes at region {int(region[i])} offset "
            f"{int(off[i])} lies outside the {len(sizes)} exposed regions"
        )


@dataclass(frozen=True)
class LaneRuns:
    """Runs of token rows x lanes (transfer.tokens: pools of different page sizes or TP
    shards). Row t of lane b on a side lies in region region[b] at

        (t // rows) * pitch[b] + offset[b] + (t % rows) * stride[b]

    and moves row_bytes[b] bytes; no run crosses a page on either side. Where both strides
    are the row (whole rows of a page-major segment) run r of lane b is one range of
    count[r] * row_bytes[b] bytes; a slice of each row (a TP shard's heads) is one range per
    row. O(runs + lanes) numbers for what flat is runs x lanes ranges (1.2 million for 32k
    tokens of a 36-layer model with one side at page 1)."""

    src_start: np.ndarray  # int64 [n_runs] rows
    dst_start: np.ndarray  # int64 [n_runs] rows
    count: np.ndarray  # int64 [n_runs] rows
    src_offset: np.ndarray  # int64 [n_lanes] bytes into a source item
    dst_offset: np.ndarray  # int64 [n_lanes] bytes into a destination item
    row_bytes: np.ndarray  # int64 [n_lanes] bytes that move per row
    src_region: np.ndarray  # int64 [n_lanes]
    dst_region: np.ndarray  # int64 [n_lanes]
    src_pitch: np.ndarray  # int64 [n_lanes] bytes per item (page) of the lane's buffer
    dst_pitch: np.ndarray  # int64 [n_lanes]
    src_stride: np.ndarray  # int64 [n_lanes] bytes from one row of a page to the next
    dst_stride: np.ndarray  # int64 [n_lanes]
    src_rows: int  # rows (tokens) per item
    dst_rows: int

    def __post_init__(self) -> None:
        if not len(self.src_start) == len(self.dst_start) == len(self.count):
            raise ValueError("lane runs: runs of different lengths")
        _check_lanes(self)
        _check_runs(self)

    @property
    def whole(self) -> np.ndarray:
        """bool [n_lanes]: rows back to back on both sides (a run is one range)."""
        return (self.src_stride == self.row_bytes) & (self.dst_stride == self.row_bytes)

    def __len__(self) -> int:
        whole = int(self.whole.sum())
        return len(self.count) * whole + int(self.count.sum()) * (len(self.row_bytes) - whole)

    @property
    def nbytes(self) -> int:
        return int(self.count.sum()) * int(self.row_bytes.sum())

    def rows(self) -> "LaneRuns":
        """The same bytes with every run cut into runs of one row."""
        n = int(self.count.sum())
        step = np.arange(n, dtype=np.int64) - np.repeat(np.cumsum(self.count) - self.count, self.count)
        return dataclasses.replace(
            self,
            src_start=np.repeat(self.src_start, self.count) + step,
            dst_start=np.repeat(self.dst_start, self.count) + step,
            count=np.ones(n, dtype=np.int64),
        )

    def _flat(self, lanes: np.ndarray) -> Ranges:
        """Lane-major flat ranges of some lanes, one per run."""
        k = len(self.count)
        at = [
            (
                start[None, :] // rows * pitch[lanes, None]
                + offset[lanes, None]
                + start[None, :] % rows * stride[lanes, None]
            ).ravel()
            for start, rows, pitch, offset, stride in (
                (self.src_start, self.src_rows, self.src_pitch, self.src_offset, self.src_stride),
                (self.dst_start, self.dst_rows, self.dst_pitch, self.dst_offset, self.dst_stride),
            )
        ]
        length = (self.count[None, :] * self.row_bytes[lanes, None]).ravel()
        return Ranges(np.repeat(self.src_region[lanes], k), at[0], np.repeat(self.dst_region[lanes], k), at[1], length)

    def flatten(self) -> Ranges:
        """Flat ranges: whole-row lanes one per run, sliced ones one per row."""
        whole = self.whole
        parts = [self._flat(np.flatnonzero(whole))]
        if not whole.all():
            parts.append(self.rows()._flat(np.flatnonzero(~whole)))
        return Ranges.concat(parts)

    def extents(self) -> tuple[np.ndarray, np.ndarray]:
        """Per lane, the end of the furthest range on each side (bytes; the end of the last
        page touched), O(runs + lanes)."""
        if not len(self.count):
            zero = np.zeros(len(self.row_bytes), dtype=np.int64)
            return zero, zero
        last = self.src_start + self.count - 1, self.dst_start + self.count - 1
        return (
            (int(last[0].max()) // self.src_rows + 1) * self.src_pitch,
            (int(last[1].max()) // self.dst_rows + 1) * self.dst_pitch,
        )


# a LaneRuns' per-lane arrays (what a lane is, apart from its runs)
LANE_FIELDS = (
    "src_offset",
    "dst_offset",
    "row_bytes",
    "src_region",
    "dst_region",
    "src_pitch",
    "dst_pitch",
    "src_stride",
    "dst_stride",
)
_CHECKED: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}  # lanes found inside their items


def _check_lanes(runs: LaneRuns) -> None:
    """Every lane's rows lie inside its item on both sides. Every send to one peer carries the
    same lane arrays (transfer.plan's, read-only): a set of them found good is not checked
    again, looked up by the arrays' identity (kept alive beside, so an id is not reused while
    cached) and only while none of them can be written to."""
    arrays = tuple(getattr(runs, f) for f in LANE_FIELDS)
    key = (*map(id, arrays), runs.src_rows, runs.dst_rows)
    hit = _CHECKED.get(key)
    if hit is not None and all(a is b for a, b in zip(hit, arrays)) and _frozen(arrays):
        return
    if len({len(a) for a in arrays}) != 1:
        raise ValueError("lane runs: lanes of different lengths")
    for side, off, pitch, stride, rows in (
        ("source", runs.src_offset, runs.src_pitch, runs.src_stride, runs.src_rows),
        ("destination", runs.dst_offset, runs.dst_pitch, runs.dst_stride, runs.dst_rows),
    ):
        if (
            rows < 1
            or (
                (off < 0)
                | (runs.row_bytes < 1)
                | (stride < runs.row_bytes)
                | (off + (rows - 1) * stride + runs.row_bytes > pitch)
            ).any()
        ):
            raise OutOfBounds(f"a {side} lane lies outside its item")
    if _frozen(arrays):
        if len(_CHECKED) >= 512:
            _CHECKED.clear()
        _CHECKED[key] = arrays


_RUNS_CHECKED: dict[tuple[int, ...], tuple[np.ndarray, ...]] = {}  # runs found inside their pages


def _check_runs(runs: LaneRuns) -> None:
    """No run leaves its page on either side. A fan-out's receivers share one plan's runs
    (transfer.plan.relane, frozen): found good once, not checked again per receiver (as
    _check_lanes, by identity and only while they cannot be written to)."""
    arrays = (runs.src_start, runs.dst_start, runs.count)
    key = (*map(id, arrays), runs.src_rows, runs.dst_rows)
    hit = _RUNS_CHECKED.get(key)
    if hit is not None and all(a is b for a, b in zip(hit, arrays)) and _frozen(arrays):
        return
    if len(runs.count) and (
        min(int(runs.src_start.min()), int(runs.dst_start.min())) < 0
        or int(runs.count.min()) < 1
        or (runs.src_start % runs.src_rows + runs.count > runs.src_rows).any()
        or (runs.dst_start % runs.dst_rows + runs.count > runs.dst_rows).any()
    ):
        raise OutOfBounds("a run of rows leaves its page")
    if _frozen(arrays):
        if len(_RUNS_CHECKED) >= 512:
            _RUNS_CHECKED.clear()
        _RUNS_CHECKED[key] = arrays


def _frozen(arrays: tuple[np.ndarray, ...]) -> bool:
    """Arrays that own their bytes and are read-only: nothing writes them behind a view."""
    return all(a.base is None and not a.flags.writeable for a in arrays)
