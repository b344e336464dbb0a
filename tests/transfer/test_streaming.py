"""Layer-wise streaming on the data path: a plan cut into layer groups moves every byte exactly
once; a streamed send writes a group as soon as its layers are final (before the last layer
is), stops between groups when the request ends, and lands byte-exact over the real Mooncake
engine and the memory transport, both layouts, direct and staged."""

import dataclasses
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from harness.peer_server import digest_request
from kvpool import HybridPool, Layout, PoolConfig, get_preset
from transfer.buffers import buffers_of
from transfer.config import Mode, TransferConfig
from transfer.cost import layer_bounds, streams_well
from transfer.errors import Cancelled
from transfer.layers import split_layers
from transfer.plan import build_plan
from transfer.progress import LayerProgress
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender, RemotePool
from transfer.transports.base import LinkCost
from transfer.transports.ranges import RunSet

from harness.peer_server import digest_tokens
from transfer.tokens import Tokens, pool_lanes
from transfer.staging import RemoteSlots
from harness.source import source_pool as _setup

PRESETS = ["tiny-hybrid", "tiny-mla-nsa", "tiny-mamba", "tiny-full"]


def _pools(preset, layout, page=4, dst_page=None):
    model = get_preset(preset)
    src, dst = (
        HybridPool(PoolConfig(model, p, max_tokens=1024, max_requests=4, layout=layout))
        for p in (page, dst_page or page)
    )
    for p in src.pools.values():
        for b in p.storage.buffers:
            b.random_(0, 256)
    return src, dst


def _apply(ranges, src: HybridPool, dst: HybridPool, written: dict) -> None:
    """Copy ranges between two pools' buffers (regions in buffer_descriptors order), counting
    every byte written so a byte written twice shows."""
    s_bufs = [d for d in src.buffer_descriptors()]
    flat_src = [_flat(src, i) for i in range(len(s_bufs))]
    flat_dst = [_flat(dst, i) for i in range(len(s_bufs))]
    for r in range(len(ranges)):
        sr, so, dr, do, n = (
            int(a[r]) for a in (ranges.src_region, ranges.src_off, ranges.dst_region, ranges.dst_off, ranges.length)
        )
        flat_dst[dr][do : do + n] = flat_src[sr][so : so + n]
        written.setdefault(dr, np.zeros(len(flat_dst[dr]), dtype=np.int32))[do : do + n] += 1


def _flat(pool: HybridPool, region: int) -> torch.Tensor:
    bufs = [b for c in pool.pools.values() for b in c.storage.buffers]
    return bufs[region].view(-1)


# page 1: 4-byte NSA scales, so rows hold alignment padding; (4, 16) and (16, 1): by token
@pytest.mark.parametrize("pages", [(1, 1), (4, 4), (4, 16), (16, 1)])
@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("preset", PRESETS)
def test_layer_groups_move_every_byte_of_the_plan_exactly_once(preset, layout, pages):
    src, dst = _pools(preset, layout, *pages)
    req, dreq = src.alloc_request(37), dst.alloc_request(37)
    src_bufs, dst_bufs = buffers_of(src.buffer_descriptors()), buffers_of(dst.buffer_descriptors())
    with PoolEndpoint(_memory(), src, TransferConfig()) as endpoint:
        placements, lanes = endpoint.placements, endpoint.lanes
    tokens = None
    if pages[0] != pages[1]:
        dst_lanes = pool_lanes(dst.config.model, pages[1], 1, layout, dst_bufs, "destination")
        tokens = Tokens(37, lanes, dst_lanes)
    plan = build_plan(src.index_set(req), dst.index_set(dreq), src_bufs, dst_bufs, tokens)
    whole: dict = {}
    _apply(plan.body_ranges(), src, dst, whole)
    if tokens:
        assert digest_tokens(dst, dreq) | {"aux": ""} == digest_tokens(src, req) | {"aux": ""}
    want = {c: p.storage.gather(dst.index_set(dreq)[c]) for c, p in dst.pools.items()}
    n = src.config.model.num_layers
    for bounds in ([0, n], [0, 1, n], list(range(n + 1)), [0, n // 2, n]):
        for p in dst.pools.values():
            for b in p.storage.buffers:
                b.zero_()
        written: dict = {}
        groups = split_layers(plan, sorted(set(bounds)), placements)
        assert sum(g.nbytes for g in groups) == sum(c.nbytes for c in plan.body)
        for g in groups:
            for c in g.body:
                _apply(c.ranges, src, dst, written)
        assert all(int(w.max()) <= 1 for w in written.values()), "a byte was written twice"
        assert {r: int(w.sum()) for r, w in written.items()} == {r: int(w.sum()) for r, w in whole.items()}
        for c, p in dst.pools.items():
            for a, b in zip(p.storage.gather(dst.index_set(dreq)[c]), want[c]):
                assert torch.equal(a, b), f"{c.value} differs with groups {bounds}"


def test_groups_that_leave_a_layer_out_are_refused():
    src, dst = _pools("tiny-hybrid", Layout.PAGE_MAJOR)
    req, dreq = src.alloc_request(8), dst.alloc_request(8)
    plan = build_plan(
        src.index_set(req),
        dst.index_set(dreq),
        buffers_of(src.buffer_descriptors()),
        buffers_of(dst.buffer_descriptors()),
    )
    with PoolEndpoint(_memory(), src, TransferConfig()) as endpoint:
        with pytest.raises(ValueError, match="leave out layers"):
            split_layers(plan, [0, 1], endpoint.placements)
        with pytest.raises(ValueError, match="must increase"):
            split_layers(plan, [0, 2, 2, 4], endpoint.placements)


def test_a_field_runset_is_one_fragment_per_item_and_stays_inside_its_item():
    one = np.ones(1, dtype=np.int64)
    rs = RunSet(
        np.array([2, 10]),
        np.array([5, 0]),
        np.array([3, 1]),
        one * 0,
        one * 1,
        one * 100,
        np.array([40]),
        np.array([20]),
    )
    flat = rs.flatten()
    assert len(rs) == len(flat) == 4 and rs.nbytes == flat.nbytes == 80
    assert flat.src_off.tolist() == [240, 340, 440, 1040] and flat.dst_off.tolist() == [540, 640, 740, 40]
    with pytest.raises(Exception, match="outside its item"):
        RunSet(one, one, one, one, one, one * 100, np.array([90]), np.array([20]))


def test_group_count_follows_the_link_and_never_exceeds_the_layers():
    tcp, config = LinkCost(28.0, 2.2), TransferConfig()
    assert layer_bounds(36, 1 << 20, tcp, config) == [0, 36]  # 0.5 ms of bytes: one group
    bounds = layer_bounds(36, 64 << 20, tcp, config)  # 30 ms: 15 groups of >= 2 ms
    assert bounds[0] == 0 and bounds[-1] == 36 and len(bounds) - 1 == 15
    assert len(layer_bounds(36, 8 << 30, tcp, config)) - 1 == 36  # at most one group per layer


def test_progress_counts_layers_in_order_and_a_stopped_wait_gives_up():
    p = LayerProgress(4)
    p.final(1)
    assert p.final_layers == 0  # layer 0 is not final yet: nothing before layer 1 is usable
    p.final(0)
    assert p.final_layers == 2
    with pytest.raises(Cancelled):
        p.wait(3, stopped=lambda: True)
    p.wait(2)
    p.complete()
    p.wait_complete()
    with pytest.raises(ValueError):
        p.final(4)


# ---- streamed sends over real transports (conformance fixtures: Mooncake, memory) ----------


class _Watched:
    """The peer's link with a flag raised at its first write (so a test can tell whether the
    send started before the last layer was reported, without timing anything)."""

    def __init__(self, link):
        self._link, self.first = link, threading.Event()
        self.writes = 0

    def __getattr__(self, name):
        return getattr(self._link, name)

    def _mark(self):
        self.writes += 1
        self.first.set()

    def write_async(self, ranges):
        self._mark()
        return self._link.write_async(ranges)

    def write(self, ranges, timeout=None):
        self._mark()
        return self._link.write(ranges, timeout)

    def write_runs_async(self, runsets):
        self._mark()
        return self._link.write_runs_async(runsets)

    def prepare_runs(self, runsets):  # (prepared ahead: the write starts at start())
        prepared, mark = self._link.prepare_runs(runsets), self._mark

        class Started:
            nbytes = prepared.nbytes

            def start(self):
                mark()
                return prepared.start()

        return Started()


def _watched(peer, sender: KVSender) -> tuple[RemotePool, _Watched]:
    """The peer connected, its link watched for the first write."""
    target = peer.connect(sender)
    watched = _Watched(target.link)
    return dataclasses.replace(target, link=watched), watched


def _engine(
    progress: LayerProgress,
    watched: _Watched,
    log: list,
    stop_after: int | None = None,
    stop: threading.Event | None = None,
):
    """Reports layers in order; before the last one it waits (up to 30 s) for the first write."""
    n = progress.num_layers
    for layer in range(n - 1):
        progress.final(layer)
        if stop_after is not None and layer == stop_after:
            watched.first.wait(30)
            log.append(("stop", watched.writes))
            stop.set()
            return
    log.append(("written before last layer", watched.first.wait(30)))
    progress.final(n - 1)
    progress.complete()


@pytest.mark.parametrize("pages", [(4, 4), (16, 4)])  # (prefill, decode); different: by token
@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("preset", ["tiny-hybrid", "tiny-mamba"])
@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_streamed_send_starts_before_the_last_layer_and_lands_byte_exact(transport, peer, preset, layout, mode, pages):
    by_token = pages[0] != pages[1]
    pool = _setup(peer, preset, pages[0], layout, peer_page=pages[1])
    config = TransferConfig(
        mode=mode, staging_slot_bytes=1 << 20, stream_group_ms=1e-9
    )  # a group per layer, on any link
    with PoolEndpoint(transport, pool, config) as endpoint:
        sender = KVSender(endpoint)
        target, watched = _watched(peer, sender)
        req = pool.alloc_request(301)
        rid, dst = peer.alloc(301)
        before = peer.digest(rid, outside=True).outside
        slots = peer.expect(7, rid, want_slots=2)
        progress, log = LayerProgress(pool.config.model.num_layers), []
        engine = threading.Thread(target=_engine, args=(progress, watched, log))
        engine.start()
        try:
            report = sender.send(
                target, pool.index_set(req), dst, RemoteSlots(7, slots, peer.channel), progress=progress, num_tokens=301
            )
        finally:
            engine.join()
        got = peer.digest(rid, outside=True, by_token=by_token)
        peer.release(7)
        assert log == [("written before last layer", True)]
        assert report.streamed and report.groups > 1 and report.mode is mode
        assert got.per_component == (digest_tokens if by_token else digest_request)(pool, req), "bytes differ"
        assert got.outside == before, "bytes outside the request changed"
        peer.free(rid)
        pool.free_request(req)
    assert peer.available().staging_free == 4


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_a_stream_stopped_between_layers_writes_nothing_more(transport, peer, mode):
    pool = _setup(peer, "tiny-hybrid", 4, Layout.PAGE_MAJOR)
    config = TransferConfig(mode=mode, staging_slot_bytes=1 << 20, stream_group_ms=1e-9)
    with PoolEndpoint(transport, pool, config) as endpoint:
        sender = KVSender(endpoint)
        target, watched = _watched(peer, sender)
        req = pool.alloc_request(301)
        rid, dst = peer.alloc(301)
        slots = peer.expect(8, rid, want_slots=2)
        progress, log, stop = LayerProgress(pool.config.model.num_layers), [], threading.Event()
        engine = threading.Thread(target=_engine, args=(progress, watched, log, 0, stop))
        engine.start()
        try:
            with pytest.raises(Cancelled):
                sender.send(
                    target,
                    pool.index_set(req),
                    dst,
                    RemoteSlots(8, slots, peer.channel),
                    stopped=stop.is_set,
                    progress=progress,
                )
        finally:
            engine.join()
        peer.release(8)
        [(_, writes_at_stop)] = log
        assert writes_at_stop >= 1 and watched.writes == writes_at_stop  # nothing after the stop
        peer.free(rid)
        pool.free_request(req)
    counts = peer.available()
    assert counts.staging_free == 4


def _memory():
    from harness import memory

    return memory.MemoryTransport()


def test_auto_streams_only_over_links_that_leave_the_compute_alone(mooncake):
    """Mooncake TCP reads a CUDA pool through host copies that slowed the prefill compute by
    20% (H100): `auto` does not stream over it from a CUDA pool; from a host pool it does."""
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=2))
    with PoolEndpoint(mooncake, pool, TransferConfig()) as endpoint:
        sender = KVSender(endpoint)
        link = mooncake.connect(endpoint.offers()[0], endpoint.exposures["mooncake"])
        assert not link.overlaps_gpu_compute and sender.streams_well(RemotePool(link, tuple(endpoint.buffers)))
        assert streams_well("cpu", link) and not streams_well("cuda:1", link)
        assert streams_well("cuda", SimpleNamespace(overlaps_gpu_compute=True))  # cuda-ipc's copy kernel


@pytest.mark.parametrize(
    "kind",
    [pytest.param("cuda-ipc", marks=pytest.mark.gpu), pytest.param("mooncake", marks=pytest.mark.gpu)],
    indirect=True,
)
def test_on_a_gpu_each_layer_goes_only_once_its_kernels_are_done(kind, transport, peer):
    """The engine reports each layer while its kernels are still queued (a GPU sleep before
    the layer's bytes change): the streamed send must move the computed bytes; the sender waits
    for each group's event before it starts the copy (without that wait the cuda-ipc case
    fails; Mooncake's own copies out of GPU memory queue behind the engine's stream as well).
    The send is prepared before the engine starts, so nothing on its way syncs the device."""
    pool = _setup(peer, "tiny-full", 4, Layout.PAGE_MAJOR)
    assert str(pool.config.device).startswith("cuda"), "a GPU test: run it with DISAGG_TEST_DEVICE=cuda"
    layers = pool.config.model.num_layers
    with PoolEndpoint(transport, pool, TransferConfig(mode=Mode.DIRECT, stream_group_ms=1e-9)) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        req = pool.alloc_request(301)
        rid, dst = peer.alloc(301)
        src = pool.index_set(req)
        prepared = sender.prepare(target, src, dst, 301, streamed=True)
        torch.cuda.synchronize()  # the pool's first bytes and the copy tables are in place
        progress = LayerProgress(layers, pool.config.device)

        def engine():
            for layer in range(layers):
                torch.cuda._sleep(50_000_000)  # ~30 ms of GPU time before this layer's KV is written
                for value, part in enumerate(("k", "v")):
                    pool.layer_view(layer, part).fill_(layer + 1 + value / 2)
                progress.final(layer)  # reported at once: its kernels are still queued
            progress.complete()

        computing = threading.Thread(target=engine)
        computing.start()
        try:
            report = sender.send(target, src, dst, num_tokens=301, progress=progress, prepared=prepared)
        finally:
            computing.join()
        torch.cuda.synchronize()
        assert report.streamed and report.prepared_ahead and report.groups == layers
        assert peer.digest(rid).per_component == digest_request(pool, req), "a layer went before its kernels ended"
        peer.free(rid)
        pool.free_request(req)
