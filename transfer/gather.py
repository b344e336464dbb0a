r"""Gathering a staged chunk into a slot with few, large torch copies: the staged sender's
hot loop. TP 1 -> 8 gathers a 1/8 head slice of every row, 72 pieces a chunk; one
index_select and its Python per piece ran at ~0.1-0.2 GB/s, and eight such sends in one
prefill process queued on its GIL.

    pieces of a chunk   (lane i, positions [a, b), slot offset o_i), i = lo, lo+1, ...
                        back to back in the slot (one component, the same positions)
    a band              lanes of one buffer at one pitch, stride and row width, a fixed
                        step apart (page-major: L0.k, L0.v, L1.k, ... of one row; a TP
                        slice of each): one [lanes, items, rows, words] view of the buffer
    rows of [a, b)      a part of the first page, whole pages, a part of the last page:
                        split (and the pages checked for being consecutive) once per chunk
                        and component, not per piece

    -> per band and positions: at most three copies (first page, whole pages: a slice when
       they are consecutive, else one index_select, last page), however many lanes it has.

Views are built once per send (Gatherer); torch copies release the GIL, so the sends of one
prefill rank to several decode ranks gather side by side. Whole-item pieces (pools of one
page size and TP) are one index_select each, as few as the component has buffers.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpool.geometry import Component
from transfer.plan import ComponentPlan
from transfer.staging import Chunk, Piece, field_view, sync, word_rows
from transfer.tokens import Lane

WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)   # widest first: uint8 copies run at a fraction


def _word(*values: int) -> torch.dtype:
    """The widest word dividing every offset, pitch and pointer given."""
    return next(d for d in WORDS if all(v % d.itemsize == 0 for v in values))


@dataclass(eq=False)
class _Band:
    """Lanes [lo, lo + n) of a component's streams: one buffer, one pitch, stride, row width
    and rows per item, lane i + 1 `step` bytes after lane i."""
    lo: int
    n: int
    buf: torch.Tensor     # the buffer, uint8 [items, pitch]
    first: Lane
    step: int
    views: dict = field(default_factory=dict)   # word type (or "rows": numpy) -> view

    def fits(self, lane: Lane) -> bool:
        """Whether `lane` extends the band as its next lane."""
        f = self.first
        if (lane.buffer, lane.pitch, lane.stride, lane.token_bytes, lane.page_size) != \
                (f.buffer, f.pitch, f.stride, f.token_bytes, f.page_size):
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
                (max(self.step, 1) // k, f.pitch // k, f.stride // k, 1), words.storage_offset() + f.offset // k)
        return self.views[word]

    def rows(self) -> np.ndarray:
        """[lanes, items, rows per item] of whole rows (numpy void items) over a host buffer:
        numpy copies rows of a TP slice (128-512 B) at 2x torch's rate for the same strides."""
        if "rows" not in self.views:
            f = self.first
            flat = self.buf.numpy().reshape(-1)
            self.views["rows"] = np.lib.stride_tricks.as_strided(
                flat[f.offset:], (self.n, self.buf.shape[0], f.page_size, f.token_bytes),
                (max(self.step, 1), f.pitch, f.stride, 1), writeable=False).view(_row(f.token_bytes))[..., 0]
        return self.views["rows"]

    def word(self, dst_ptr: int) -> torch.dtype:
        f = self.first
        return _word(f.token_bytes, self.step, f.pitch, f.stride, self.buf.data_ptr() + f.offset, dst_ptr)


def _row(nbytes: int) -> np.dtype:
    return np.dtype((np.void, nbytes))


def bands(lanes: Sequence[Lane], tensors: Sequence[torch.Tensor]) -> list[_Band]:
    """A component's lanes (in stream order) cut into bands, each as long as the lanes allow."""
    out: list[_Band] = []
    for i, lane in enumerate(lanes):
        if out and out[-1].fits(lane):
            out[-1].add(lane)
        else:
            out.append(_Band(i, 1, tensors[lane.buffer], lane, 0))
    return out


@dataclass(frozen=True)
class Rows:
    """Token rows of a run of positions as (page, slot) spans: `head` rows from one page,
    runs of consecutive whole pages, `tail` rows of one page."""
    head: tuple[int, int, int] | None        # (page, first slot, rows)
    runs: tuple[tuple[int, int], ...]        # (first page, pages), in order
    tail: tuple[int, int] | None             # (page, rows): slots [0, rows)
    pages: np.ndarray                        # the whole pages, in order (int64)


def split_rows(rows: np.ndarray, page_size: int) -> Rows | None:
    """`rows` (int64) as a partial first page, whole pages and a partial last page (what
    consecutive positions give), or None when they are not so laid out."""
    n, p = len(rows), page_size
    if n == 0:
        return None
    head_n = min(n, -int(rows[0]) % p)
    whole = (n - head_n) // p * p
    tail_n = n - head_n - whole
    head, body, tail = rows[:head_n], rows[head_n:head_n + whole], rows[head_n + whole:]
    pages = body[::p] // p
    ok = (np.array_equal(head, rows[0] + np.arange(head_n)) and np.array_equal(tail, tail[:1] + np.arange(tail_n))
          and (tail_n == 0 or tail[0] % p == 0)
          and np.array_equal(body, (pages[:, None] * p + np.arange(p)).reshape(-1)))
    if not ok:
        return None
    cuts = np.flatnonzero(np.diff(pages) != 1) + 1
    starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [len(pages)]))
    runs = tuple((int(pages[a]), int(b - a)) for a, b in zip(starts, ends) if b > a)
    return Rows((int(rows[0]) // p, int(rows[0]) % p, head_n) if head_n else None, runs,
                (int(tail[0]) // p, tail_n) if tail_n else None, np.ascontiguousarray(pages, dtype=np.int64))


def _pages(rows, m: int, p: int):
    """[lanes, m * p, ...] as [lanes, m, p, ...], a view (a numpy reshape may copy silently)."""
    if isinstance(rows, torch.Tensor):
        return rows.view(rows.shape[0], m, p, *rows.shape[2:])
    s = rows.strides
    return np.lib.stride_tricks.as_strided(rows, (rows.shape[0], m, p, *rows.shape[2:]), (s[0], s[1] * p, *s[1:]))


RUNS_BY_SLICE = 8   # a device tensor's pages in more runs than this: one index_select, not a copy per run


def _put(dst, src) -> None:
    if isinstance(dst, np.ndarray):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def copy_rows(src, spans: Rows, dst) -> None:
    """dst [lanes, rows] = the spans' rows of src [lanes, items, rows per item], both numpy
    arrays of rows (void) or both tensors ([..., words] then); a slice copy per span, except
    a device tensor's pages in many runs (one index_select)."""
    p, at = src.shape[2], 0
    if spans.head:
        page, first, k = spans.head
        _put(dst[:, :k], src[:, page, first:first + k])
        at = k
    m = len(spans.pages)
    if m:
        out = _pages(dst[:, at:at + m * p], m, p)
        if isinstance(src, torch.Tensor) and len(spans.runs) > RUNS_BY_SLICE:
            out.copy_(torch.index_select(src, 1, torch.from_numpy(spans.pages).to(src.device)))
        else:
            done = 0
            for page, k in spans.runs:
                _put(out[:, done:done + k], src[:, page:page + k])
                done += k
        at += m * p
    if spans.tail:
        page, k = spans.tail
        _put(dst[:, at:at + k], src[:, page, :k])


def copy_indexed(src, rows: np.ndarray, dst) -> None:
    """Any rows, by index (what split_rows does not cut into spans)."""
    p = src.shape[2]
    if isinstance(src, np.ndarray):
        np.copyto(dst, src[:, rows // p, rows % p])
        return
    r = torch.from_numpy(np.array(rows, dtype=np.int64)).to(src.device)
    dst.copy_(src[:, r // p, r % p])


class Gatherer:
    """One send's gathers: its body's lanes cut into bands once (their views built on first
    use), then each chunk gathered into a slot with a few copies per band (the module's
    docstring draws it). Pieces come from chunk_plan of this body: trusted, not re-checked."""

    def __init__(self, body: Sequence[ComponentPlan], tensors: dict[Component, list[torch.Tensor]]):
        self.plans = {cp.component: cp for cp in body}
        self.tensors = tensors
        self.band_of: dict[Component, dict[int, tuple[_Band, int]]] = {}
        for cp in body:
            if cp.by_token:
                ids = [cp.buffer_id(i) for i in range(cp.streams)]
                self.band_of[cp.component] = {ids[b.lo + k]: (b, k) for b in bands(cp.src_lanes, tensors[cp.component])
                                              for k in range(b.n)}

    def gather(self, chunk: Chunk, slot: torch.Tensor) -> None:
        """Copy the chunk's source rows and items into `slot`; returns once they are there."""
        devices, spans, i = {slot.device}, {}, 0
        while i < len(chunk.pieces):
            p = chunk.pieces[i]
            if p.by_token:
                i = self._lanes(chunk.pieces, i, slot, spans, devices)
            else:
                self._items(p, slot, devices)
                i += 1
        for device in devices:
            sync(device)

    def _run(self, pieces: Sequence[Piece], i: int) -> tuple[_Band, int, int]:
        """(band, first lane in it, pieces) of the longest run of pieces from i that one band
        gathers in one go: the next lanes of the band, the same positions, back to back."""
        p = pieces[i]
        c = Component(p.component)
        band, k = self.band_of[c][p.buffer]
        size, j = p.count * band.first.token_bytes, i + 1
        while j < len(pieces) and k + j - i < band.n:
            q = pieces[j]
            if not (q.by_token and q.component == p.component and q.first == p.first and q.count == p.count
                    and q.offset == p.offset + (j - i) * size):
                break
            b2, k2 = self.band_of[c].get(q.buffer, (None, -1))
            if b2 is not band or k2 != k + j - i:
                break
            j += 1
        return band, k, j - i

    def _lanes(self, pieces: Sequence[Piece], i: int, slot: torch.Tensor, spans: dict, devices: set) -> int:
        """Gather the run of by-token pieces from i (see _run); the index after it."""
        band, k, n = self._run(pieces, i)
        p = pieces[i]
        cp = self.plans[Component(p.component)]
        first = p.first - cp.first_position
        rows = cp.src_idx[first:first + p.count]
        key = (p.component, p.first, p.count, band.first.page_size)
        if key not in spans:
            spans[key] = split_rows(rows, band.first.page_size)
        out = slot[p.offset:p.offset + n * p.count * band.first.token_bytes]
        if band.buf.device.type == "cpu" and out.device.type == "cpu":
            src, dst = band.rows()[k:k + n], out.numpy().view(_row(band.first.token_bytes)).reshape(n, p.count)
        else:
            word = band.word(out.data_ptr())
            src, dst = band.view(word)[k:k + n], (out.view(word) if word is not torch.uint8 else out).view(n, p.count, -1)
        if spans[key] is None:
            copy_indexed(src, rows, dst)
        else:
            copy_rows(src, spans[key], dst)
        devices.add(band.buf.device)
        return i + n

    def _items(self, p: Piece, slot: torch.Tensor, devices: set) -> None:
        """A whole-item piece: its items of one buffer (or a field of each), one index_select."""
        c = Component(p.component)
        cp = self.plans[c]
        buf = field_view(self.tensors[c][p.buffer], p)
        width = buf.shape[1]
        first = p.first - cp.first_item
        idx = torch.from_numpy(np.array(cp.src_idx[first:first + p.count], dtype=np.int64)).to(buf.device)
        out = slot[p.offset:p.offset + p.count * width].view(p.count, width)
        if out.device == buf.device:  # one kernel straight into the slot
            torch.index_select(word_rows(buf, width), 0, idx, out=word_rows(out, width))
        else:  # e.g. a host staging area for a GPU pool
            out.copy_(buf.index_select(0, idx))
        devices.add(buf.device)
