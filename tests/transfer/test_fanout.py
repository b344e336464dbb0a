"""A fan-out (transfer.fanout: one prefill rank into several decode ranks at once), on the CPU:
the plan made once and relaned for every receiver whose pages are the same is the plan each
would have had alone; the cuda-ipc fan-out's table (transfer/transports/cuda_fan.py: lanes of
shared runs merged, every receiver's ranges checked against its own regions) run through
copy_kernel.cu itself (tests/transfer/kernel_cpu.py) writes into every receiver exactly the
bytes its own plan names, in one copy_lanes launch per component. The GPU side (the fan's
stream, its events, sender processes) is tests/transfer/test_sender_process.py's."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

from kvpool import Layout
from kvpool.indices import IndexSet
from transfer.errors import OutOfBounds
from transfer.plan import build_plan, relane
from transfer.reshard import pair_lanes
from transfer.tokens import Tokens
from transfer.transports.cuda_fan import checked_work, merge
from transfer.transports.cuda_layout import Regions, lay_out
from transfer.transports.ranges import LaneRuns

from kernel_cpu import CpuKernel
from test_copy_kernel_cpu import _expected, _Side

TOKENS = 300


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> CpuKernel:
    return CpuKernel(tmp_path_factory.mktemp("copy_kernel"))


def _fan(preset: str, m: int, layout: Layout = Layout.PAGE_MAJOR):
    """A TP 1 source and its m receivers (TP m ranks, pools alike: the same pages), and each
    receiver's Tokens and plan made on its own."""
    src = _Side(preset, 16, layout, (1, 0), 1)
    dsts = [_Side(preset, 16, layout, (m, s), 2 + s) for s in range(m)]
    for d in dsts[1:]:  # (each shuffled by its own seed: make them allocate alike)
        for a, b in ((d.pool.pages, dsts[0].pool.pages), (d.pool.swa_allocator, dsts[0].pool.swa_allocator)):
            inner = getattr(a, "swa", a) if a is not None else None
            if inner is not None:
                inner._stack[:] = getattr(b, "swa", b)._stack
    src_set = src.pool.index_set(src.pool.alloc_request(TOKENS))
    out = []
    for d in dsts:
        mine, theirs = pair_lanes(src.pool.config.model, src.shard, d.shard, src.lanes, d.lanes)
        tokens = Tokens(TOKENS, mine, theirs, True)
        dst_set = d.pool.index_set(d.pool.alloc_request(TOKENS))
        out.append((d, dst_set, tokens, build_plan(src_set, dst_set, src.bufs, d.bufs, tokens)))
    return src, src_set, out


def _fields_equal(a, b) -> bool:
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if not (np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y):
            return False
    return True


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "tiny-hybrid", "tiny-mla-nsa"])
def test_a_plan_relaned_for_a_receiver_of_the_same_pages_is_its_own_plan(preset):
    _, _, rx = _fan(preset, 2 if preset.startswith("tiny") else 8)
    (_, like, _, base) = rx[0]
    for d, dst_set, tokens, alone in rx[1:]:
        got = relane(base, like, dst_set, d.bufs, tokens)
        assert got is not None
        assert [c.component for c in got.components] == [c.component for c in alone.components]
        assert all(_fields_equal(a.runset, b.runset) for a, b in zip(got.components, alone.components))
        assert got.nbytes == alone.nbytes and got.num_ranges == alone.num_ranges
        assert all(a.runs is b.runs for a, b in zip(got.components, base.components))  # planned once


def test_a_receiver_whose_pages_differ_is_planned_on_its_own():
    _, _, rx = _fan("gpt-oss-20b", 2)
    (_, like, _, base), (d, dst_set, tokens, _) = rx
    c = dst_set.components()[0]
    other = IndexSet({k: (dst_set[k][::-1].copy() if k is c else dst_set[k]) for k in dst_set.components()})
    assert relane(base, like, other, d.bufs, tokens) is None


@pytest.mark.parametrize("preset, m", [("gpt-oss-20b", 8), ("tiny-hybrid", 2), ("tiny-mla-nsa", 2)])
def test_one_fan_out_table_writes_every_receivers_bytes(kernel, preset, m):
    src, _, rx = _fan(preset, m)
    base, like = rx[0][3], rx[0][1]
    plans = [base] + [relane(base, like, s, d.bufs, t) for d, s, t, _ in rx[1:]]
    parts = [
        (SimpleNamespace(_ours=src.regions, _theirs=d.regions), [[c.runset for c in p.body], [p.aux.runset]])
        for (d, *_), p in zip(rx, plans)
    ]
    expected = [_expected([rs for g in groups for rs in g], src, d) for (d, *_), (_, groups) in zip(rx, parts)]
    source = [v.copy() for v in src.views]
    merged = merge(parts)
    laid = lay_out(checked_work([link for link, _ in parts], merged))
    assert laid.nbytes == sum(p.nbytes for p in plans)
    lanes = [rs for g in merged for rs, _ in g if isinstance(rs, LaneRuns)]
    assert len(lanes) == sum(isinstance(c.runset, LaneRuns) for c in base.components)  # one per component
    assert all(len(members) == m for g in merged for rs, members in g if isinstance(rs, LaneRuns))
    kernel.run(laid, blocks=32)
    for (d, *_), want in zip(rx, expected):
        assert all(np.array_equal(got, w) for got, w in zip(d.views, want))
    assert all(np.array_equal(a, b) for a, b in zip(src.views, source))


def test_each_receivers_ranges_are_checked_against_its_own_regions():
    src, _, rx = _fan("gpt-oss-20b", 2)
    base, like = rx[0][3], rx[0][1]
    plans = [base, relane(base, like, rx[1][1], rx[1][0].bufs, rx[1][2])]
    small = rx[1][0].regions
    cut = Regions("destination", small.bases, small.sizes // 64)  # the second receiver offered less
    links = [
        SimpleNamespace(_ours=src.regions, _theirs=rx[0][0].regions),
        SimpleNamespace(_ours=src.regions, _theirs=cut),
    ]
    parts = [(link, [[c.runset for c in p.body]]) for link, p in zip(links, plans)]
    with pytest.raises(OutOfBounds, match="destination"):
        checked_work(links, merge(parts))


@pytest.mark.gpu
@pytest.mark.slow
def test_on_a_gpu_a_receiver_gone_or_aborted_fails_alone():
    """A fan-out one of whose links closed before it started: that receiver's send fails
    (PeerUnreachable), the other's lands byte-exact (sent on its own), as without a fan-out.
    Then one whose receiver was aborted: it is Cancelled and nothing is written for it."""
    from disagg.engine.standin import StandInEngine
    from harness.peer_client import PeerProcess
    from kvpool import HybridPool, PoolConfig, get_preset
    from transfer.config import Mode, TransferConfig
    from transfer.endpoint import PoolEndpoint
    from transfer.errors import Cancelled, PeerUnreachable
    from transfer.fanout import FanOut, FanOutSend
    from transfer.sender import KVSender
    from transfer.transports import TransportSettings, create

    preset, page, room = "tiny-swa", 4, 5
    ids = np.random.default_rng(room).integers(0, 50000, TOKENS)
    [transport] = create(["cuda-ipc"], TransportSettings(device="cuda:0"))
    pool = HybridPool(PoolConfig(get_preset(preset), page, max_tokens=1024, max_requests=2, device="cuda"))
    req = pool.alloc_request(TOKENS)
    StandInEngine().prefill(pool, req, ids, room)
    peers = [PeerProcess(preset, page, 4096, transport="cuda-ipc", device="cuda") for _ in range(2)]
    try:
        with PoolEndpoint(transport, pool, TransferConfig(mode=Mode.DIRECT)) as endpoint:
            sender, rids, dsts = KVSender(endpoint), [], []
            for s, peer in enumerate(peers):
                peer.configure(preset, page, 1024, max_requests=2, device="cuda", tp=(2, s))
                rid, dst = peer.alloc(TOKENS)
                rids.append(rid)
                dsts.append(dst)
            links = [p.connect(sender) for p in peers]
            links[1].link.close()  # decode rank 1 went away
            fan = [FanOutSend(t, d) for t, d in zip(links, dsts)]
            assert FanOut.fits(fan)
            got = FanOut(sender).send(pool.index_set(req), fan, num_tokens=TOKENS)
            assert isinstance(got[1], PeerUnreachable) and got[0].nbytes > 0, got
            peers[0].verify(rids[0], ids, room)
            links[1] = peers[1].connect(sender)
            before = peers[1].digest(rids[1])
            fan = [FanOutSend(links[0], dsts[0]), FanOutSend(links[1], dsts[1], stopped=lambda: True)]
            got = FanOut(sender).send(pool.index_set(req), fan, num_tokens=TOKENS)
            assert isinstance(got[1], Cancelled) and got[0].nbytes > 0, got
            assert peers[1].digest(rids[1]) == before
            peers[0].verify(rids[0], ids, room)
            for link, peer, rid in zip(links, peers, rids):
                link.link.close()
                peer.free(rid)
    finally:
        for peer in peers:
            peer.close()
