"""TP shards of different sizes (transfer.reshard): N prefill ranks into M decode ranks.

Every prefill rank's pool is filled by the stand-in engine (a rank's bytes are its heads' of
the whole model's row), each decode rank receives from the prefill ranks that hold its
heads, and the stand-in's verify on that decode rank checks every position it holds and
its state, byte for byte; nothing outside the request changes. The receiver runs behind the
real Mooncake engine in another process, and behind the in-process memory transport."""

import os

import numpy as np
import pytest

from harness import memory
from harness.peer_client import LocalPeer
from disagg.engine.standin import StandInEngine
from kvpool import HybridPool, Layout, PoolConfig, get_preset
from kvpool.geometry import components
from transfer.config import Mode, TransferConfig
from transfer.errors import LayoutIncompatible
from transfer.reshard import Shard, senders as senders_of
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender
from transfer.staging import RemoteSlots

TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
PAGES = [(4, 4), (4, 16), (16, 1)]  # (prefill, decode), cycled over the cases
TOKENS = 157


DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")  # both sides' pools (cuda-ipc: cuda)


def _prefill_ranks(preset: str, tp: int, page: int, layout: Layout, tokens: np.ndarray, room: int, device: str):
    """`tp` prefill pools, each rank's KV written by the stand-in; (pool, request) per rank."""
    out = []
    for rank in range(tp):
        pool = HybridPool(
            PoolConfig(
                get_preset(preset),
                page,
                max_tokens=1024,
                max_requests=4,
                layout=layout,
                tp_size=tp,
                tp_rank=rank,
                device=device,
            )
        )
        np.random.default_rng(rank).shuffle(pool.pages._stack[: pool.pages.num_free])
        for p in pool.pools.values():
            for b in p.storage.buffers:
                b.random_(0, 256)
        req = pool.alloc_request(len(tokens))
        StandInEngine().prefill(pool, req, tokens, room)
        out.append((pool, req))
    return out


def reshard_into(transport, peer, preset, tp, pages, layout, mode, room=7):
    """Every decode rank of tp[1] in turn (the peer reconfigured as it), from every prefill
    rank of tp[0] that sends it anything; returns (sends per decode rank, reports)."""
    model = get_preset(preset)
    tokens = np.random.default_rng(room).integers(0, 50000, TOKENS)
    device = "cpu" if isinstance(peer, LocalPeer) else DEVICE  # the memory transport copies host memory
    prefill = _prefill_ranks(preset, tp[0], pages[0], layout, tokens, room, device)
    senders_per_rank, reports = [], []
    for s in range(tp[1]):
        peer.configure(
            preset,
            pages[1],
            1024,
            layout=layout.value,
            max_requests=4,
            staging_slots=4,
            staging_slot_mib=1,
            tp=(tp[1], s),
            device=device,
        )
        peer.fragment(s)
        rid, dst = peer.alloc(TOKENS)
        before = peer.digest(rid, outside=True).outside
        dst_shard = Shard(pages[1], tp[1], s)
        senders = list(senders_of(model, tp[0], dst_shard, components(model)))
        for r in senders:
            pool, req = prefill[r]
            with PoolEndpoint(transport, pool, TransferConfig(mode=mode, staging_slot_bytes=1 << 20)) as endpoint:
                sender = KVSender(endpoint)
                target = peer.connect(sender)
                slots = peer.expect(r + 1, rid, want_slots=2, sender=(pages[0], tp[0], r))
                reports.append(
                    sender.send(
                        target, pool.index_set(req), dst, RemoteSlots(r + 1, slots, peer.channel), num_tokens=TOKENS
                    )
                )
                peer.release(r + 1)
        peer.verify(rid, tokens, room)
        assert peer.digest(rid, outside=True).outside == before, "bytes outside the request changed"
        peer.free(rid)
        assert peer.available().staging_free == 4
        senders_per_rank.append(senders)
    return senders_per_rank, reports


CASES = [(tp, preset) for tp in TP_PAIRS for preset in ("tiny-swa", "tiny-mamba", "tiny-mla-nsa", "tiny-hybrid")]


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
@pytest.mark.parametrize("tp,preset", CASES)
def test_every_decode_rank_gets_its_heads_byte_exact(transport, peer, tp, preset, mode):
    i = CASES.index((tp, preset))
    layout = list(Layout)[i % 2]
    senders, reports = reshard_into(transport, peer, preset, tp, PAGES[i % len(PAGES)], layout, mode)
    assert all(r.mode is mode for r in reports)
    assert all(senders), "every decode rank hears from some prefill rank"
    n, m = tp  # decode rank d hears only from prefill ranks holding its heads (replicated: one of them)
    for d, got in enumerate(senders):
        assert got[0] == d * n // m and got[-1] < max(d * n // m + 1, (d + 1) * n // m)
        assert len(got) == 1 if n <= m or preset == "tiny-mla-nsa" else len(got) >= 1


def test_a_receiver_refuses_a_sender_whose_tp_size_cannot_split_the_model():
    from transfer.receiver import KVReceiver

    with PoolEndpoint(memory.MemoryTransport(), _pool(tp=(2, 1)), TransferConfig()) as endpoint:
        receiver = KVReceiver(endpoint)
        assert receiver.lanes_from(Shard(4, 2, 1)) is None  # our shard: whole pages
        assert len(receiver.lanes_from(Shard(4, 1, 0))) == 3  # full, swa, aux from TP 1
        with pytest.raises(LayoutIncompatible, match="TP size 3"):
            receiver.lanes_from(Shard(4, 3, 0))


def _pool(preset="tiny-swa", tp=(1, 0), page=4):
    return HybridPool(
        PoolConfig(get_preset(preset), page, max_tokens=256, max_requests=2, tp_size=tp[0], tp_rank=tp[1], device="cpu")
    )


@pytest.mark.parametrize(
    "receiver,claim,message",
    [
        ((1, 0), (3, 0), "TP size 3: .*neither divisible by nor a divisor of TP size 3"),  # 2 heads, 3 ranks
        ((1, 0), (2, 0), "buffers are not those of tiny-swa"),  # TP 1 buffers claimed as a TP 2 rank's
        ((2, 1), (2, 1), "equal TP sizes pair rank r with rank r"),  # we are rank 0 of 2
        ((2, 0), (2, 2), "TP rank 2 of size 2"),
    ],
)
def test_a_receiver_claiming_heads_it_cannot_hold_is_refused_at_connect(receiver, claim, message):
    src_tp = (2, 0) if receiver[0] == 2 else (1, 0)
    with (
        PoolEndpoint(memory.MemoryTransport(), _pool(tp=src_tp), TransferConfig()) as endpoint,
        PoolEndpoint(memory.MemoryTransport(), _pool(tp=receiver), TransferConfig()) as other,
    ):
        sender = KVSender(endpoint)
        with pytest.raises(LayoutIncompatible, match=message):
            sender.connect(other.offers(), other.buffers, other.staging_info(), 4, claim)


@pytest.mark.parametrize("layout", list(Layout))
def test_a_streamed_send_between_tp_sizes_moves_every_slice_once(layout):
    """Layer groups of a resharded plan (one group per layer) cover its bytes exactly, and a
    streamed send (progress reported layer by layer) lands byte for byte."""
    from transfer.layers import split_layers
    from transfer.progress import LayerProgress

    model = get_preset("tiny-hybrid")
    tokens = np.random.default_rng(3).integers(0, 50000, TOKENS)
    ((pool, req),) = _prefill_ranks("tiny-hybrid", 1, 4, layout, tokens, 5, "cpu")
    with LocalPeer(memory.MemoryTransport(), "tiny-hybrid", 4, 1024) as peer:
        peer.configure("tiny-hybrid", 16, 1024, layout=layout.value, max_requests=4, tp=(2, 1))
        rid, dst = peer.alloc(TOKENS)
        with PoolEndpoint(memory.MemoryTransport(), pool, TransferConfig(mode=Mode.DIRECT)) as endpoint:
            sender = KVSender(endpoint)
            target = peer.connect(sender)
            plan = sender.plan(target, pool.index_set(req), dst, TOKENS)
            groups = split_layers(plan, list(range(model.num_layers + 1)), endpoint.placements)
            assert sum(g.nbytes for g in groups) == sum(c.nbytes for c in plan.body)
            assert sum(1 for g in groups if g.body) == model.num_layers  # every tiny-hybrid layer holds KV
            progress = LayerProgress(model.num_layers)
            for layer in range(model.num_layers):
                progress.final(layer)
            progress.complete()
            report = sender.send(target, pool.index_set(req), dst, progress=progress, num_tokens=TOKENS)
        assert report.streamed
        peer.verify(rid, tokens, 5)


def test_staging_slots_are_sized_for_the_suffix_only():
    """A request whose first positions decode holds (its prefix cache) leases slots for the rest."""
    from transfer.receiver import KVReceiver

    pool = HybridPool(PoolConfig(get_preset("tiny-swa"), 16, max_tokens=65536, max_requests=2, device="cpu"))
    with PoolEndpoint(memory.MemoryTransport(), pool, TransferConfig(staging_slot_bytes=1 << 16)) as endpoint:
        receiver = KVReceiver(endpoint)
        lanes = receiver.lanes_from(Shard(4, 1, 0))  # pages 4 -> 16: by token
        whole = receiver.slots_wanted(lanes, 8000, 64)
        assert receiver.slots_wanted(lanes, 8000, 64, prefix_len=7936) < whole / 10
        assert receiver.slots_wanted(lanes, 8000, 64, prefix_len=0) == whole
