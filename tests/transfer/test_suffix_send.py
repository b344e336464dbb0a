"""Suffix-only sends end to end (transfer.suffix): the receiver holds positions [0, prefix_len)
of a request already (a decode that cached that prefix); the sender moves only the rest.

Decode's prefix positions are first filled with random bytes: after the send they are byte for
byte what they were (nothing of the prefix was written), and the report's bytes are what the
rules say should move, worked out here from the geometry. Then the prefix gets the bytes a
decode that cached it holds (the stand-in's), and the stand-in's verify checks every position
and the state byte for byte: the suffix landed exactly. Nothing outside the request changes.
Over the real Mooncake engine (receiver in another process) and the in-process memory
transport, direct and staged, both layouts, every component kind, pools of the same and of
different page sizes, TP 2 -> 1 and 1 -> 2."""

import numpy as np
import pytest
import torch

from harness import memory
from harness.peer_client import LocalPeer
from harness.source import device_for
from kvpool import Component, HybridPool, Layout, PoolConfig, get_preset
from kvpool.geometry import components, item_bytes
from transfer.buffers import buffers_of, by_component
from transfer.config import Mode, TransferConfig
from transfer.errors import BadPrefix, StagingError
from transfer.reshard import Shard, senders as senders_of
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender
from transfer.staging import Piece, RemoteSlots, StagingArea, scatter
from transfer.tokens import TokenRows, pool_lanes

from test_reshard import _prefill_ranks

N = 164
# (preset, (prefill page, TP), (decode page, TP), prefix_len)
CASES = [
    ("tiny-hybrid", (16, 1), (16, 1), 96),  # whole pages; the SWA window after the prefix
    ("tiny-hybrid", (16, 1), (16, 1), 160),  # whole pages; the prefix reaches into the window
    ("tiny-swa", (4, 1), (4, 1), 164),  # decode holds every position: state and AUX only
    ("tiny-swa", (16, 1), (32, 1), 160),  # page sizes differ: 160 splits no decode page
    ("tiny-mla-nsa", (32, 1), (16, 1), 144),  # ... and splits a prefill page
    ("tiny-mamba", (4, 1), (16, 1), 96),
    ("tiny-hybrid", (16, 2), (16, 1), 160),  # TP 2 -> 1
    ("tiny-mla-nsa", (16, 2), (16, 1), 96),
    ("tiny-hybrid", (16, 1), (16, 2), 96),  # TP 1 -> 2
    ("tiny-mamba", (4, 1), (32, 2), 128),
    ("tiny-swa", (16, 1), (4, 2), 160),
]


def expected_bytes(model, src, dst, prefix_len: int, dst_buffers) -> int:
    """What one decode rank receives from all its senders, from the rules alone: paged
    components from prefix_len on (SWA: the window positions at or after it), state whole."""
    whole = src == dst  # same page size and TP: whole pages
    n, pd, ps = N, dst[0], src[0]
    out = 0
    for c in components(model):
        if c.per_request:
            out += item_bytes(model, c, 1, dst[1])
            continue
        window_first = max(0, n - model.swa.window) if c is Component.SWA else 0
        if whole:
            first_page = max(window_first // pd, prefix_len // pd)
            out += (-(-n // pd) - first_page) * sum(b.item_bytes for b in by_component(dst_buffers)[c])
        else:
            first = max(prefix_len, window_first // ps * ps, window_first // pd * pd)
            out += (n - first) * item_bytes(model, c, 1, dst[1])
    return out


def send_suffix(transport, peer, preset, src, dst, layout, mode, prefix_len, room=11):
    """Every decode rank of dst in turn from its prefill ranks, with a prefix held; returns the reports."""
    model = get_preset(preset)
    tokens = np.random.default_rng(room).integers(0, 50000, N)
    device = device_for(peer)
    prefill = _prefill_ranks(preset, src[1], src[0], layout, tokens, room, device)
    reports = []
    for d in range(dst[1]):
        target = peer.configure(
            preset,
            dst[0],
            1024,
            layout=layout.value,
            max_requests=4,
            staging_slots=4,
            staging_slot_mib=1,
            tp=(dst[1], d),
            device=device,
        )
        peer.fragment(d)
        rid, dst_set = peer.alloc(N)
        peer.fill(rid, tokens, room + 1, prefix_len, garbage=True)  # decode's own prefix: must stay as it is
        prefix_before = peer.digest(rid, below=prefix_len).per_component
        outside_before = peer.digest(rid, outside=True).outside
        ranks = senders_of(model, src[1], Shard(dst[0], dst[1], d), components(model))
        mine = []
        for r in ranks:
            pool, req = prefill[r]
            with PoolEndpoint(transport, pool, TransferConfig(mode=mode, staging_slot_bytes=1 << 20)) as endpoint:
                sender = KVSender(endpoint)
                link = peer.connect(sender)
                slots = peer.expect(r + 1, rid, 2, (src[0], src[1], r), prefix_len)
                mine.append(
                    sender.send(
                        link,
                        pool.index_set(req),
                        dst_set,
                        RemoteSlots(r + 1, slots, peer.channel),
                        num_tokens=N,
                        prefix_len=prefix_len,
                    )
                )
                peer.release(r + 1)
        assert sum(rep.nbytes for rep in mine) == expected_bytes(model, src, dst, prefix_len, target.buffers)
        assert peer.digest(rid, below=prefix_len).per_component == prefix_before, "a prefix byte was written"
        assert peer.digest(rid, outside=True).outside == outside_before, "bytes outside the request changed"
        peer.fill(rid, tokens, room, prefix_len)  # the prefix as decode's cache holds it
        peer.verify(rid, tokens, room)  # every position it holds, and the state: byte-equal
        peer.free(rid)
        assert peer.available().staging_free == 4
        reports += mine
    return reports


@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
@pytest.mark.parametrize("preset,src,dst,prefix_len", CASES)
def test_only_the_suffix_moves_and_lands_byte_equal(transport, peer, preset, src, dst, prefix_len, mode):
    layout = list(Layout)[CASES.index((preset, src, dst, prefix_len)) % 2]
    reports = send_suffix(transport, peer, preset, src, dst, layout, mode, prefix_len)
    assert reports and all(r.mode is mode for r in reports)


def test_a_bad_prefix_len_moves_nothing(transport, peer):
    """Refused before a byte moves: the receiver's pool is as it was."""
    tokens = np.random.default_rng(3).integers(0, 50000, N)
    ((pool, req),) = _prefill_ranks("tiny-hybrid", 1, 4, Layout.PAGE_MAJOR, tokens, 3, device_for(peer))
    peer.configure(
        "tiny-hybrid", 16, 1024, max_requests=4, staging_slots=4, staging_slot_mib=1, device=device_for(peer)
    )
    rid, dst_set = peer.alloc(N)
    before = peer.digest(rid, outside=True)
    with PoolEndpoint(transport, pool, TransferConfig(mode=Mode.DIRECT)) as endpoint:
        sender = KVSender(endpoint)
        link = peer.connect(sender)
        for bad, why in (
            (8, "not a multiple of the receiver's page size 16"),
            (-16, "negative"),
            (176, "beyond the prompt's 164 tokens"),
        ):
            with pytest.raises(BadPrefix, match=why):
                sender.send(link, pool.index_set(req), dst_set, num_tokens=N, prefix_len=bad)
    assert peer.digest(rid, outside=True) == before
    peer.free(rid)


@pytest.mark.parametrize("layout", list(Layout))
@pytest.mark.parametrize("src,dst", [((16, 1), (16, 1)), ((4, 1), (16, 1)), ((16, 1), (16, 2))])
@pytest.mark.parametrize("mode", [Mode.DIRECT, Mode.STAGED])
def test_a_streamed_suffix_send_lands_byte_equal(src, dst, layout, mode):
    """Layer groups (fields of page-major rows, buffers, lanes) of a suffix plan: the same
    positions as a whole send, each once; the prefix untouched."""
    from transfer.progress import LayerProgress

    model = get_preset("tiny-hybrid")
    tokens = np.random.default_rng(5).integers(0, 50000, N)
    prefill = _prefill_ranks("tiny-hybrid", src[1], src[0], layout, tokens, 5, "cpu")
    with LocalPeer(memory.MemoryTransport(), "tiny-hybrid", 4, 1024) as peer:
        target = peer.configure(
            "tiny-hybrid",
            dst[0],
            1024,
            layout=layout.value,
            max_requests=4,
            staging_slots=4,
            staging_slot_mib=1,
            tp=(dst[1], 0),
        )
        rid, dst_set = peer.alloc(N)
        peer.fill(rid, tokens, 6, 160, garbage=True)
        before = peer.digest(rid, below=160).per_component
        ((pool, req),) = prefill[:1]
        config = TransferConfig(mode=mode, staging_slot_bytes=1 << 20, stream_group_ms=1e-6)  # a group per layer
        with PoolEndpoint(memory.MemoryTransport(), pool, config) as endpoint:
            sender = KVSender(endpoint)
            link = peer.connect(sender)
            slots = peer.expect(1, rid, 2, (src[0], src[1], 0), 160)
            progress = LayerProgress(model.num_layers)
            for layer in range(model.num_layers):
                progress.final(layer)
            progress.complete()
            report = sender.send(
                link,
                pool.index_set(req),
                dst_set,
                RemoteSlots(1, slots, peer.channel),
                num_tokens=N,
                progress=progress,
                prefix_len=160,
            )
            peer.release(1)
        assert report.streamed and report.groups > 1
        assert report.nbytes == expected_bytes(model, src, dst, 160, target.buffers)
        assert peer.digest(rid, below=160).per_component == before
        peer.fill(rid, tokens, 5, 160)
        peer.verify(rid, tokens, 5)


@pytest.fixture()
def held():
    """A receiver's request of 40 tokens whose first 32 positions (two pages of 16) it holds."""
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 16, max_tokens=512, max_requests=4))
    req = pool.alloc_request(40, swa_window_only=True)
    area = StagingArea(2, 4096, "cpu")
    area.buffer.random_(0, 256)
    buffers = {c: p.storage.buffers for c, p in pool.pools.items()}
    lanes = pool_lanes(pool.config.model, 16, 1, pool.config.layout, buffers_of(pool.buffer_descriptors()), "test")
    return pool, req, buffers, area, TokenRows(40, {c: l for c, l in lanes.items() if not c.per_request}, 32)


@pytest.mark.parametrize(
    "pieces,message",
    [
        (
            [Piece("full", 0, 1, 1, 0)],
            r"items \[1, 2\) of full write pages of the prefix held here \(its indices \[0, 2\)\)",
        ),
        ([Piece("full", 0, 2, 1, 0), Piece("nsa", 0, 0, 3, 1024)], "of nsa write pages of the prefix"),
        ([Piece("full", 0, 31, 2, 0, by_token=True)], r"positions \[31, 33\) outside the full positions \[32, 40\)"),
        ([Piece("swa", 0, 30, 1, 0, by_token=True)], r"outside the swa positions \[32, 40\)"),
    ],
)
def test_a_piece_writing_the_held_prefix_is_refused_before_any_write(held, pieces, message):
    """Staged pieces are untrusted: the receiver refuses any that would write below prefix_len."""
    pool, req, buffers, area, own = held
    before = [b.clone() for p in pool.pools.values() for b in p.storage.buffers]
    with pytest.raises(StagingError, match=message):
        scatter(0, 0, pieces, pool.index_set(req), buffers, area, own=own)
    assert all(torch.equal(a, b) for a, b in zip(before, [b for p in pool.pools.values() for b in p.storage.buffers]))
    scatter(
        0, 0, [Piece("full", 0, 2, 1, 0), Piece("mamba", 0, 0, 1, 1024)], pool.index_set(req), buffers, area, own=own
    )
