r"""Gathering a staged chunk into a slot: the staged sender's hot loop, a few large copies
per chunk (transfer.bands) where one indexed copy per piece and its Python ran at ~0.1-0.2
GB/s, and a prefill rank's eight sends of TP 1 -> 8 queued on its GIL.

    pieces of a chunk   (lane i, positions [a, b), slot offset o_i), i = lo, lo+1, ...
                        back to back in the slot: one component, the same positions
    -> one run          the lanes i of one band (transfer.bands) gathered in one go, the
                        rows of [a, b) split into spans once per chunk and component

Bands are cut once per send (Gatherer); copies release the GIL, so the sends of one prefill
rank to several decode ranks gather side by side. Whole-item pieces (pools of one page size
and TP) are one index_select each, as few as the component has buffers.
"""

from collections.abc import Sequence

import numpy as np
import torch

from kvpool.geometry import Component
from transfer.bands import Band, band_copy, band_index, lane_run, split_rows
from transfer.plan import ComponentPlan
from transfer.staging import Chunk, Piece, field_view, sync, word_rows


class Gatherer:
    """One send's gathers: its body's lanes cut into bands once (their views built on first
    use), then each chunk gathered into a slot with a few copies per band (the module's
    docstring draws it). Pieces come from chunk_plan of this body: trusted, not re-checked."""

    def __init__(self, body: Sequence[ComponentPlan], tensors: dict[Component, list[torch.Tensor]]):
        self.plans = {cp.component: cp for cp in body}
        self.tensors = tensors
        self.band_of: dict[Component, dict[int, tuple[Band, int]]] = {}
        for cp in body:
            if cp.by_token:
                ids = [cp.buffer_id(i) for i in range(cp.streams)]  # a piece names a lane by its id
                self.band_of[cp.component] = {
                    ids[i]: at for i, at in band_index(cp.src_lanes, tensors[cp.component]).items()
                }

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

    def _lanes(self, pieces: Sequence[Piece], i: int, slot: torch.Tensor, spans: dict, devices: set) -> int:
        """Gather the run of by-token pieces from i (transfer.bands.lane_run); the index after it."""
        p = pieces[i]
        band, k, n = lane_run(pieces, i, self.band_of[Component(p.component)])
        cp = self.plans[Component(p.component)]
        first = p.first - cp.first_position
        rows = cp.src_idx[first : first + p.count]
        key = (p.component, p.first, p.count, band.first.page_size)
        if key not in spans:
            spans[key] = split_rows(rows, band.first.page_size)
        part = slot[p.offset : p.offset + n * p.count * band.first.token_bytes]
        band_copy(band, slice(k, k + n), rows, spans[key], part, into_pool=False)
        devices.add(band.buf.device)
        return i + n

    def _items(self, p: Piece, slot: torch.Tensor, devices: set) -> None:
        """A whole-item piece: its items of one buffer (or a field of each), one index_select."""
        c = Component(p.component)
        cp = self.plans[c]
        buf = field_view(self.tensors[c][p.buffer], p)
        width = buf.shape[1]
        first = p.first - cp.first_item
        idx = torch.from_numpy(np.array(cp.src_idx[first : first + p.count], dtype=np.int64)).to(buf.device)
        out = slot[p.offset : p.offset + p.count * width].view(p.count, width)
        if out.device == buf.device:  # one kernel straight into the slot
            torch.index_select(word_rows(buf, width), 0, idx, out=word_rows(out, width))
        else:  # e.g. a host staging area for a GPU pool
            out.copy_(buf.index_select(0, idx))
        devices.add(buf.device)
