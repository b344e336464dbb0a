"""Gathered sends (transfer.gathered): where one prefill rank covers the whole of a decode
rank's rows (TP 1 -> 8, 1 -> 2; also equal TP at another page size), the sender gathers into
an image of decode's pages and writes them straight into its pool: no receiver slot, no
chunk notice, no ack.

Over the real Mooncake engine, the receiver in another process (its pages shuffled, so
runs break): every decode rank's KV lands byte for byte (the stand-in's verify), its own
prefix is not written, nothing outside the request changes, the report says "gathered", and
the chunk channel hears nothing although slots were lent. A receiver whose rows a sender
covers only in part (2 -> 1) still goes staged; a send stopped mid-way ends Cancelled with
no write in flight and its local slots back."""

import numpy as np
import pytest

from harness.peer_client import PeerProcess
from kvpool import Layout, get_preset
from kvpool.geometry import components
from transfer.config import Mode, TransferConfig
from transfer.cost import choose_mode
from transfer.endpoint import PoolEndpoint
from transfer.errors import Cancelled
from transfer.progress import LayerProgress
from transfer.reshard import Shard, senders as senders_of
from transfer.sender import KVSender
from transfer.staging import RemoteSlots
from transfer.transports.base import LinkCost

from test_reshard import _prefill_ranks

N = 300  # gpt-oss: past the 128-token window; neither a multiple of 16 nor of 64


@pytest.fixture(scope="module")
def peer():
    with PeerProcess("tiny-swa", 4, 1024, transport="mooncake") as p:
        yield p


class CountingChannel:
    """The peer's own chunk channel, counting what a sender tells it."""

    def __init__(self, channel):
        self.channel, self.notices = channel, 0

    def notify(self, transfer_id, index, slot, pieces) -> None:
        self.notices += 1
        self.channel.notify(transfer_id, index, slot, pieces)

    def wait_done(self, transfer_id, index, timeout) -> None:
        self.channel.wait_done(transfer_id, index, timeout)

    def end(self, transfer_id) -> None:
        self.channel.end(transfer_id)


def send_all(mooncake, peer, preset, src, dst, prefix_len=0, layout=Layout.PAGE_MAJOR, room=9, progress=False):
    """Every decode rank of dst = (page, TP) in turn from the prefill ranks of src that send
    it anything, slots lent, decode holding [0, prefix_len) already (random bytes that must
    stay); each rank checked byte for byte. Returns (reports, notices the channel heard)."""
    model = get_preset(preset)
    tokens = np.random.default_rng(room).integers(0, 50000, N)
    prefill = _prefill_ranks(preset, src[1], src[0], layout, tokens, room, "cpu")
    reports, notices = [], 0
    for d in range(dst[1]):
        peer.configure(preset, dst[0], 1024, layout=layout.value, staging_slot_mib=1, tp=(dst[1], d))
        peer.fragment(d)
        rid, dst_set = peer.alloc(N)
        peer.fill(rid, tokens, room + 1, prefix_len, garbage=True)
        prefix_before = peer.digest(rid, below=prefix_len).per_component if prefix_len else None
        outside_before = peer.digest(rid, outside=True).outside
        for r in senders_of(model, src[1], Shard(dst[0], dst[1], d), components(model)):
            pool, req = prefill[r]
            config = TransferConfig(staging_slot_bytes=1 << 18, stream_group_ms=1e-6)  # chunks break pages
            with PoolEndpoint(mooncake, pool, config) as endpoint:
                sender = KVSender(endpoint)
                link = peer.connect(sender)
                slots = peer.expect(r + 1, rid, 2, (src[0], src[1], r), prefix_len)
                channel = CountingChannel(peer.channel)
                reports.append(
                    sender.send(
                        link,
                        pool.index_set(req),
                        dst_set,
                        RemoteSlots(r + 1, slots, channel),
                        num_tokens=N,
                        prefix_len=prefix_len,
                        progress=_final(model.num_layers) if progress else None,
                    )
                )
                peer.release(r + 1)
                notices += channel.notices
                assert endpoint.staging.lease.available() == endpoint.staging.num_slots
        if prefix_len:
            assert peer.digest(rid, below=prefix_len).per_component == prefix_before, "a prefix byte was written"
        assert peer.digest(rid, outside=True).outside == outside_before, "bytes outside the request changed"
        peer.fill(rid, tokens, room, prefix_len)
        peer.verify(rid, tokens, room)
        peer.free(rid)
    return reports, notices


def _final(num_layers: int) -> LayerProgress:
    progress = LayerProgress(num_layers)
    for layer in range(num_layers):
        progress.final(layer)
    progress.complete()
    return progress


GATHERED = [
    ("gpt-oss-20b", (16, 1), (16, 8), 0, Layout.PAGE_MAJOR),  # TP 1 -> 8
    ("gpt-oss-20b", (16, 1), (64, 8), 128, Layout.PAGE_MAJOR),  # ... pages 16:64, a prefix
    ("gpt-oss-20b", (64, 1), (16, 8), 64, Layout.PAGE_MAJOR),  # ... pages 64:16
    ("tiny-swa", (4, 1), (4, 2), 0, Layout.LAYER_MAJOR),  # TP 1 -> 2
    ("tiny-hybrid", (16, 1), (4, 2), 96, Layout.PAGE_MAJOR),  # ... state slots, NSA, pages 16:4, a prefix
    ("tiny-mla-nsa", (4, 1), (16, 1), 32, Layout.LAYER_MAJOR),  # equal TP, pages 4:16
]


@pytest.mark.parametrize("preset,src,dst,prefix_len,layout", GATHERED)
def test_a_sender_covering_whole_rows_writes_straight_into_the_pages(
    mooncake, peer, preset, src, dst, prefix_len, layout
):
    reports, notices = send_all(mooncake, peer, preset, src, dst, prefix_len, layout)
    assert reports and all(r.mode is Mode.GATHERED for r in reports), [r.mode for r in reports]
    assert all(r.chunks >= 1 and r.ranges > r.chunks for r in reports)
    assert notices == 0, "a gathered send told the receiver of chunks"


def test_a_streamed_gathered_send_lands_byte_equal(mooncake, peer):
    reports, notices = send_all(mooncake, peer, "tiny-hybrid", (4, 1), (16, 2), 32, progress=True)
    assert all(r.mode is Mode.GATHERED and r.streamed and r.groups > 1 for r in reports)
    assert notices == 0


def test_a_sender_covering_part_of_the_rows_still_goes_staged(mooncake, peer):
    """TP 2 -> 1: each prefill rank holds half of every decode row."""
    reports, notices = send_all(mooncake, peer, "tiny-swa", (4, 2), (4, 1))
    assert len(reports) == 2 and all(r.mode is Mode.STAGED for r in reports)
    assert notices >= 2


def test_a_stopped_gathered_send_ends_cancelled_with_no_write_in_flight(mooncake, peer):
    tokens = np.random.default_rng(4).integers(0, 50000, N)
    ((pool, req),) = _prefill_ranks("gpt-oss-20b", 1, 16, Layout.PAGE_MAJOR, tokens, 4, "cpu")
    peer.configure("gpt-oss-20b", 16, 1024, tp=(8, 3))
    rid, dst_set = peer.alloc(N)
    outside_before = peer.digest(rid, outside=True).outside
    asked = []

    def stopped() -> bool:  # asked before planning and before every chunk's write: stops at the third chunk
        asked.append(1)
        return len(asked) > 3

    config = TransferConfig(mode=Mode.GATHERED, staging_slot_bytes=1 << 17)  # two pages a chunk
    with PoolEndpoint(mooncake, pool, config) as endpoint:
        sender = KVSender(endpoint)
        link = peer.connect(sender)
        with pytest.raises(Cancelled):
            sender.send(link, pool.index_set(req), dst_set, num_tokens=N, stopped=stopped)
        assert len(asked) == 4, "the send went on after it was stopped"
        assert endpoint.staging.lease.available() == endpoint.staging.num_slots
        assert endpoint.unsettled() == 0
    assert peer.digest(rid, outside=True).outside == outside_before
    peer.free(rid)


@pytest.mark.parametrize(
    "preset,src,dst,slot_bytes,modes",
    [
        # covers the receiver's whole rows: gathered or direct, never staged, unless configured
        ("tiny-swa", (4, 1), (4, 2), 1 << 18, {Mode.AUTO: False, Mode.GATHERED: False, Mode.STAGED: True}),
        ("tiny-hybrid", (16, 1), (4, 2), 1 << 18, {Mode.AUTO: False, Mode.DIRECT: False}),
        ("tiny-mla-nsa", (4, 1), (16, 1), 1 << 18, {Mode.AUTO: False}),  # equal TP, pages 4:16
        ("gpt-oss-20b", (16, 1), (16, 8), 1 << 15, {Mode.AUTO: True}),  # a decode page fills no slot of ours
        ("tiny-swa", (4, 2), (4, 1), 1 << 18, {Mode.AUTO: True, Mode.DIRECT: False}),  # half of each row
        ("tiny-swa", (4, 1), (4, 1), 1 << 18, {Mode.AUTO: True}),  # whole pages: staged where cheaper
    ],
)
def test_a_sender_says_whether_it_may_ever_stage_into_a_receiver(mooncake, peer, preset, src, dst, slot_bytes, modes):
    """What prefill answers decode's registration with (Registered.may_stage): False only where
    no send to it can go staged (its mode, or every by-token lane pairing gatherable), so
    decode lends it no slot."""
    tokens = np.random.default_rng(5).integers(0, 50000, 40)
    (pool, _), *_ = _prefill_ranks(preset, src[1], src[0], Layout.PAGE_MAJOR, tokens, 5, "cpu")
    peer.configure(preset, dst[0], 1024, tp=(dst[1], 0))
    for mode, want in modes.items():
        with PoolEndpoint(mooncake, pool, TransferConfig(mode=mode, staging_slot_bytes=slot_bytes)) as endpoint:
            sender = KVSender(endpoint)
            assert sender.may_stage(peer.connect(sender)) is want, mode


def test_a_send_lent_no_slot_never_goes_staged():
    """A sender that told decode it never stages gets no slot, so a send whose own gather
    plan fails goes direct (can_stage False), whatever the mode."""
    from transfer.plan import TransferPlan

    class Body:
        nbytes, num_ranges = 100 << 20, 60_000

    plan, tcp = TransferPlan((Body(),), None), LinkCost(per_range_us=28.0, link_gbps=2.2)
    for mode in Mode:
        assert choose_mode(plan, tcp, TransferConfig(mode=mode), 16 << 20, False, None) is Mode.DIRECT, mode
        assert choose_mode(plan, tcp, TransferConfig(mode=mode), 16 << 20, False, 200) is not Mode.STAGED, mode


def test_the_mode_choice():
    """Gathered where the send can go so (AUTO: weighed against direct; no receiver slot
    needed), staged and direct where configured."""
    from transfer.plan import TransferPlan

    class Body:
        nbytes, num_ranges = 100 << 20, 60_000

    plan = TransferPlan((Body(),), None)
    tcp = LinkCost(per_range_us=28.0, link_gbps=2.2)
    auto = TransferConfig()
    assert choose_mode(plan, tcp, auto, 16 << 20, False, 200) is Mode.GATHERED
    assert choose_mode(plan, tcp, auto, 16 << 20, True, 200) is Mode.GATHERED
    assert choose_mode(plan, tcp, auto, 16 << 20, True, None) is Mode.STAGED
    assert choose_mode(plan, tcp, auto, 16 << 20, False, None) is Mode.DIRECT
    assert choose_mode(plan, tcp, TransferConfig(mode=Mode.STAGED), 16 << 20, True, 200) is Mode.STAGED
    assert choose_mode(plan, tcp, TransferConfig(mode=Mode.DIRECT), 16 << 20, True, 200) is Mode.DIRECT
    free_ranges = LinkCost(per_range_us=0.0, link_gbps=300.0)  # cuda-ipc's figures: direct
    assert choose_mode(plan, free_ranges, auto, 16 << 20, True, 200) is Mode.DIRECT
