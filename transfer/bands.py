r"""Lanes as bands and token rows as spans: copies between a pool's lanes and a staging
slot with few, large operations (transfer.gather on the sender, transfer.staging's scatter
on the receiver). TP 1 -> 8 moves a 1/8 head slice of every row, 72 lanes a chunk; an
indexed copy and its Python per lane ran at ~0.1-0.2 GB/s.

    a band         lanes of one buffer at one pitch, stride and row width, a fixed step
                   apart (page-major: L0.k, L0.v, L1.k, ... of one row, or a TP slice of
                   each): one [lanes, items, rows per item] view of the buffer
    rows (spans)   the token rows of a run of positions: a part of the first page, runs of
                   consecutive whole pages, a part of the last page (split once per chunk
                   and component, not per lane)

    -> per band and positions: a slice copy per span (numpy void rows on the host: 2x
       torch's strided copy; torch words on a device, one indexed copy where the pages fall
       in many runs), however many lanes the band has. Copies release the GIL.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from transfer.tokens import Lane

WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)  # widest first: uint8 copies run at a fraction


def _word(*values: int) -> torch.dtype:
    """The widest word dividing every offset, pitch and pointer given."""
    return next(d for d in WORDS if all(v % d.itemsize == 0 for v in values))


@dataclass(eq=False)
class Band:
    """Lanes [lo, lo + n) of a component's streams: one buffer, one pitch, stride, row width
    and rows per item, lane i + 1 `step` bytes after lane i."""

    lo: int
    n: int
    buf: torch.Tensor  # the buffer, uint8 [items, pitch]
    first: Lane
    step: int
    views: dict = field(default_factory=dict)  # word type (or "rows": numpy) -> view

    def fits(self, lane: Lane) -> bool:
        """Whether `lane` extends the band as its next lane."""
        f = self.first
        if (lane.buffer, lane.pitch, lane.stride, lane.token_bytes, lane.page_size) != (
            f.buffer,
            f.pitch,
            f.stride,
            f.token_bytes,
            f.page_size,
        ):
            return False
        step = lane.offset - f.offset if self.n == 1 else self.step
        return step > 0 and lane.offset == f.offset + self.n * step

    def add(self, lane: Lane) -> None:
        if self.n == 1:
            self.step = lane.offset - self.first.offset
        self.n += 1

    def view(self, word: torch.dtype) -> torch.Tensor:
        """[lanes, items, rows, words of a row] over the buffer (built once per word type)."""
        if word not in self.views:
            f, k = self.first, word.itemsize
            words = self.buf.view(word) if word is not torch.uint8 else self.buf
            self.views[word] = words.as_strided(
                (self.n, self.buf.shape[0], f.page_size, f.token_bytes // k),
                (max(self.step, 1) // k, f.pitch // k, f.stride // k, 1),
                words.storage_offset() + f.offset // k,
            )
        return self.views[word]

    def rows(self) -> np.ndarray:
        """[lanes, items, rows per item] of whole rows (numpy void items) over a host buffer:
        numpy copies rows of a TP slice (128-512 B) at 2x torch's rate for the same strides."""
        if "rows" not in self.views:
            f = self.first
            flat = self.buf.numpy().reshape(-1)
            self.views["rows"] = np.lib.stride_tricks.as_strided(
                flat[f.offset :],
                (self.n, self.buf.shape[0], f.page_size, f.token_bytes),
                (max(self.step, 1), f.pitch, f.stride, 1),
            ).view(_row(f.token_bytes))[..., 0]
        return self.views["rows"]

    def word(self, dst_ptr: int) -> torch.dtype:
        f = self.first
        return _word(f.token_bytes, self.step, f.pitch, f.stride, self.buf.data_ptr() + f.offset, dst_ptr)


def _row(nbytes: int) -> np.dtype:
    return np.dtype((np.void, nbytes))


def bands(lanes: Sequence[Lane], tensors: Sequence[torch.Tensor]) -> list[Band]:
    """A component's lanes (in stream order) cut into bands, each as long as the lanes allow."""
    out: list[Band] = []
    for i, lane in enumerate(lanes):
        if out and out[-1].fits(lane):
            out[-1].add(lane)
        else:
            out.append(Band(i, 1, tensors[lane.buffer], lane, 0))
    return out


def band_index(lanes: Sequence[Lane], tensors: Sequence[torch.Tensor]) -> dict[int, tuple[Band, int]]:
    """Lane i -> (its band, its place in the band)."""
    return {b.lo + k: (b, k) for b in bands(lanes, tensors) for k in range(b.n)}


def lane_run(pieces: Sequence, i: int, band_of: Mapping[int, tuple[Band, int]]) -> tuple[Band, int, int]:
    """(band, first lane in it, pieces) of the longest run of staged pieces (transfer.staging.
    Piece, by token) from i that one band moves in one go: the band's next lanes, the same
    positions, back to back in the slot."""
    p = pieces[i]
    band, k = band_of[p.buffer]
    size, j = p.count * band.first.token_bytes, i + 1
    while j < len(pieces) and k + j - i < band.n:
        q = pieces[j]
        if not (
            q.by_token
            and q.component == p.component
            and q.first == p.first
            and q.count == p.count
            and q.offset == p.offset + (j - i) * size
        ):
            break
        b2, k2 = band_of.get(q.buffer, (None, -1))
        if b2 is not band or k2 != k + j - i:
            break
        j += 1
    return band, k, j - i


@dataclass(frozen=True)
class Rows:
    """Token rows of a run of positions as (page, slot) spans: `head` rows from one page,
    runs of consecutive whole pages, `tail` rows of one page."""

    head: tuple[int, int, int] | None  # (page, first slot, rows)
    runs: tuple[tuple[int, int], ...]  # (first page, pages), in order
    tail: tuple[int, int] | None  # (page, rows): slots [0, rows)
    pages: np.ndarray  # the whole pages, in order (int64)


def split_rows(rows: np.ndarray, page_size: int) -> Rows | None:
    """`rows` (int64) as a partial first page, whole pages and a partial last page (what
    consecutive positions give), or None when they are not so laid out."""
    n, p = len(rows), page_size
    if n == 0:
        return None
    head_n = min(n, -int(rows[0]) % p)
    whole = (n - head_n) // p * p
    tail_n = n - head_n - whole
    head, body, tail = rows[:head_n], rows[head_n : head_n + whole], rows[head_n + whole :]
    pages = body[::p] // p
    ok = (
        np.array_equal(head, rows[0] + np.arange(head_n))
        and np.array_equal(tail, tail[:1] + np.arange(tail_n))
        and (tail_n == 0 or tail[0] % p == 0)
        and np.array_equal(body, (pages[:, None] * p + np.arange(p)).reshape(-1))
    )
    if not ok:
        return None
    cuts = np.flatnonzero(np.diff(pages) != 1) + 1
    starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [len(pages)]))
    runs = tuple((int(pages[a]), int(b - a)) for a, b in zip(starts, ends) if b > a)
    return Rows(
        (int(rows[0]) // p, int(rows[0]) % p, head_n) if head_n else None,
        runs,
        (int(tail[0]) // p, tail_n) if tail_n else None,
        np.ascontiguousarray(pages, dtype=np.int64),
    )


def _pages(rows, m: int, p: int):
    """[lanes, m * p, ...] as [lanes, m, p, ...], a view (a numpy reshape may copy silently)."""
    if isinstance(rows, torch.Tensor):
        return rows.view(rows.shape[0], m, p, *rows.shape[2:])
    s = rows.strides
    return np.lib.stride_tricks.as_strided(rows, (rows.shape[0], m, p, *rows.shape[2:]), (s[0], s[1] * p, *s[1:]))


RUNS_BY_SLICE = 8  # a device tensor's pages in more runs than this: one index_select, not a copy per run


def _put(dst, src) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def _move(pool, rows, into_pool: bool) -> None:
    if into_pool:
        _put(pool, rows)
    else:
        _put(rows, pool)


def copy_rows(pool, spans: Rows, rows, into_pool: bool) -> None:
    """Between pool [lanes, items, rows per item] and rows [lanes, rows] (the slot's side),
    both numpy arrays of rows (void) or both tensors ([..., words] then), the spans' rows:
    a slice copy per span, except a device tensor's pages in many runs (one indexed copy)."""
    p, at = pool.shape[2], 0
    if spans.head:
        page, first, k = spans.head
        _move(pool[:, page, first : first + k], rows[:, :k], into_pool)
        at = k
    m = len(spans.pages)
    if m:
        part = _pages(rows[:, at : at + m * p], m, p)
        if isinstance(pool, torch.Tensor) and len(spans.runs) > RUNS_BY_SLICE:
            pages = torch.from_numpy(spans.pages).to(pool.device)
            if into_pool:
                pool.index_copy_(1, pages, part.to(pool.device))
            else:
                part.copy_(torch.index_select(pool, 1, pages))
        else:
            done = 0
            for page, k in spans.runs:
                _move(pool[:, page : page + k], part[:, done : done + k], into_pool)
                done += k
        at += m * p
    if spans.tail:
        page, k = spans.tail
        _move(pool[:, page, :k], rows[:, at : at + k], into_pool)


def copy_indexed(pool, idx: np.ndarray, rows, into_pool: bool) -> None:
    """Any rows `idx`, by index (what split_rows does not cut into spans)."""
    p = pool.shape[2]
    if isinstance(pool, np.ndarray):
        if into_pool:
            pool[:, idx // p, idx % p] = rows
        else:
            np.copyto(rows, pool[:, idx // p, idx % p])
        return
    r = torch.from_numpy(np.array(idx, dtype=np.int64)).to(pool.device)
    if into_pool:
        pool[:, r // p, r % p] = rows.to(pool.device)
    else:
        rows.copy_(pool[:, r // p, r % p])


def band_copy(
    band: Band, lanes: slice, idx: np.ndarray, spans: Rows | None, part: torch.Tensor, into_pool: bool
) -> None:
    """Rows `idx` (split as `spans`) of the band's `lanes` to or from `part` of a slot (uint8,
    [lanes, rows, row bytes] back to back): numpy rows on the host, torch words elsewhere."""
    n, tb = lanes.stop - lanes.start, band.first.token_bytes
    if band.buf.device.type == "cpu" and part.device.type == "cpu":
        pool, rows = band.rows()[lanes], part.numpy().view(_row(tb)).reshape(n, -1)
    else:
        word = band.word(part.data_ptr())
        pool = band.view(word)[lanes]
        rows = (part.view(word) if word is not torch.uint8 else part).view(n, -1, tb // word.itemsize)
    if spans is None:
        copy_indexed(pool, idx, rows, into_pool)
    else:
        copy_rows(pool, spans, rows, into_pool)
