"""Gathering staged chunks (transfer.gather): every piece's bytes are its lane's rows by the
lane's own definition (Lane.at), whatever the pages' order, the page sizes, the layout and
where a slot cuts a lane; and a chunk of one component's TP slices over consecutive pages is
one band and one run of pages (a few copies, not one or three per piece)."""

import os

import numpy as np
import pytest
import torch

from harness import memory
from kvpool import HybridPool, Layout, PoolConfig, get_preset
from transfer.config import TransferConfig
from transfer.endpoint import PoolEndpoint
from transfer.bands import bands, split_rows
from transfer.gather import Gatherer
from transfer.plan import build_plan
from transfer.reshard import Shard, pair_lanes
from transfer.staging import chunk_plan
from transfer.tokens import Tokens

DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")  # cuda: the device copies (scripts/device/checks.sh)


def _pool(preset, page, layout, tp=(1, 0), shuffle=False):
    pool = HybridPool(
        PoolConfig(
            get_preset(preset),
            page,
            max_tokens=1024,
            max_requests=2,
            layout=layout,
            tp_size=tp[0],
            tp_rank=tp[1],
            device=DEVICE,
        )
    )
    if shuffle:
        np.random.default_rng(page).shuffle(pool.pages._stack[: pool.pages.num_free])
    for p in pool.pools.values():
        for b in p.storage.buffers:
            b.random_(0, 256)
    return pool


def _plan(src, dst, n):
    """A by-lane plan from src into dst (TP shards or page sizes differ) and src's endpoint."""
    t = memory.MemoryTransport()
    sep, dep = PoolEndpoint(t, src, TransferConfig()), PoolEndpoint(t, dst, TransferConfig())
    sc, dc = src.config, dst.config
    lanes = pair_lanes(
        sc.model,
        Shard(sc.page_size, sc.tp_size, sc.tp_rank),
        Shard(dc.page_size, dc.tp_size, dc.tp_rank),
        sep.lanes,
        dep.lanes,
    )
    sreq, dreq = src.alloc_request(n), dst.alloc_request(n)
    plan = build_plan(
        src.index_set(sreq), dst.index_set(dreq), sep.buffers, dep.buffers, Tokens(n, *lanes, sc.tp_size != dc.tp_size)
    )
    dep.close()
    return plan, sep


def _expected(piece, cp, tensors):
    """The piece's bytes by the lane's definition: each row at Lane.at in its buffer (a
    whole-item piece: its items, or their field)."""
    if not piece.by_token:
        first = piece.first - cp.first_item
        items = torch.from_numpy(np.array(cp.src_idx[first : first + piece.count], dtype=np.int64))
        buf = tensors[cp.component][piece.buffer][items.to(DEVICE)]
        return (buf[:, piece.field_off : piece.field_off + piece.field_len] if piece.field_len else buf).reshape(-1)
    ids = [cp.buffer_id(i) for i in range(cp.streams)]
    lane = cp.src_lanes[ids.index(piece.buffer)]
    first = piece.first - cp.first_position
    flat = tensors[cp.component][lane.buffer].reshape(-1)
    at = lane.at(cp.src_idx[first : first + piece.count])
    return torch.cat([flat[a : a + lane.token_bytes] for a in at.tolist()])


@pytest.mark.parametrize(
    "preset,pages,tp,layout,n",
    [
        ("tiny-hybrid", (4, 4), (2, 1), Layout.PAGE_MAJOR, 157),  # TP slices, page-major bands
        ("tiny-hybrid", (4, 16), (1, 0), Layout.PAGE_MAJOR, 157),  # page sizes differ
        ("tiny-hybrid", (16, 4), (2, 0), Layout.LAYER_MAJOR, 150),  # one lane per buffer
        ("tiny-swa", (1, 4), (4, 3), Layout.PAGE_MAJOR, 61),  # page size 1: every row its own page
        ("tiny-mla-nsa", (16, 4), (1, 0), Layout.PAGE_MAJOR, 100),
    ],
)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("slot_bytes", [1 << 20, 4096 + 48])  # small: slots cut lanes mid-way
def test_every_gathered_piece_is_its_lanes_rows(preset, pages, tp, layout, n, shuffle, slot_bytes):
    src = _pool(preset, pages[0], layout, shuffle=shuffle)
    dst = _pool(preset, pages[1], layout, tp)
    plan, sep = _plan(src, dst, n)
    slot = torch.zeros(slot_bytes + 8, dtype=torch.uint8, device=DEVICE)[8:]
    gatherer = Gatherer(plan.body, sep.tensors)
    by_comp = {cp.component.value: cp for cp in plan.body}
    pieces = 0
    for chunk in chunk_plan(plan.body, slot_bytes):
        slot.fill_(0xAB)
        gatherer.gather(chunk, slot)
        for p in chunk.pieces:
            want = _expected(p, by_comp[p.component], sep.tensors)
            assert torch.equal(slot[p.offset : p.offset + len(want)], want), p
            pieces += 1
    assert pieces > 0
    sep.close()


def test_one_components_slices_over_consecutive_pages_are_one_band_and_one_run():
    """TP 1 -> 2, page-major, K and V rows of one size (tiny-swa): every lane of a component
    is a slice of one buffer's rows a segment apart (one band), and consecutive positions on consecutive pages are one run of
    whole pages between a partial first and last page: a handful of copies per chunk."""
    src, dst = _pool("tiny-swa", 4, Layout.PAGE_MAJOR), _pool("tiny-swa", 4, Layout.PAGE_MAJOR, (2, 1))
    plan, sep = _plan(src, dst, 157)
    for cp in plan.body:
        assert len(bands(cp.src_lanes, sep.tensors[cp.component])) == 1, cp.component
    rows = np.arange(4 * 7 + 2, 4 * 20 + 3)  # page 7 from slot 2 .. page 20 slot 2
    spans = split_rows(rows, 4)
    assert spans.head == (7, 2, 2) and spans.runs == ((8, 12),) and spans.tail == (20, 3)
    broken = np.concatenate([np.arange(8, 16), np.arange(40, 44)])  # pages 2, 3, then 10
    assert split_rows(broken, 4).runs == ((2, 2), (10, 1))
    assert split_rows(np.array([5, 4]), 4) is None  # not consecutive: by index
    sep.close()
