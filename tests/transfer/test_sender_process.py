"""A prefill rank per process (harness.sender_server, as bench_tp --senders process runs them):
TP 2 prefill ranks, each in a process of its own, send their heads into one decode rank (a
harness peer process) at once, staged and direct, equal and mixed page sizes, every byte
verified by the stand-in. On a GPU machine the same over cuda-ipc with every process's pool on
one GPU (the pools shared to the receiver by CUDA IPC), which is how bench_tp's GPU rows
measure the transfer rather than one process's GIL (issue 40)."""

import numpy as np
import pytest

from harness.peer_client import PeerProcess
from harness.sender_client import SenderProcess
from harness.wire import SendTo
from kvpool import get_preset
from kvpool.geometry import components
from transfer.config import Mode
from transfer.reshard import Shard, senders as senders_of

pytestmark = pytest.mark.slow
PRESET, ROOM, TOKENS = "tiny-swa", 11, 300


@pytest.mark.parametrize(
    "kind",
    ["mooncake", pytest.param("cuda-ipc", marks=pytest.mark.gpu)],
)
@pytest.mark.parametrize("mode,pages", [("staged", (8, 4)), ("direct", (4, 4))])
@pytest.mark.parametrize("ahead", [False, True], ids=["planned-inline", "prepared-ahead"])
def test_each_prefill_rank_sends_from_a_process_of_its_own(kind, mode, pages, ahead):
    """ahead: each send laid out first (Prepare, as a worker does while the KV computes); the
    Send then starts from it, and its report says so."""
    device = "cuda" if kind == "cuda-ipc" else "cpu"
    ids = np.random.default_rng(TOKENS).integers(0, 50000, TOKENS)  # what each sender process prefilled
    ranks = senders_of(get_preset(PRESET), 2, Shard(pages[1], 1, 0), components(get_preset(PRESET)))
    assert list(ranks) == [0, 1]
    with PeerProcess(PRESET, pages[1], 4096, transport=kind, device=device, chunk_channels=3) as peer:
        peer.configure(PRESET, pages[1], 1024, max_requests=2, staging_slots=4, device=device)
        initial = peer.available()
        rid, dst = peer.alloc(TOKENS)
        procs = [
            SenderProcess(
                PRESET, pages[0], TOKENS, (2, r), seed=TOKENS, room=ROOM, mode=mode, device=device, transport=kind
            )
            for r in ranks
        ]
        try:
            procs = [p.ready() for p in procs]
            arrays = {c.value: dst[c].astype(np.int32).tobytes() for c in dst.components()}
            for r, p in zip(ranks, procs):
                p.link(0, peer.target(), peer.channels[1 + r])
                slots = peer.expect(1 + r, rid, want_slots=2, sender=(pages[0], 2, r))
                if ahead:
                    p.prepare([SendTo(0, 1 + r, arrays, slots)])
                p.start_send([SendTo(0, 1 + r, arrays, slots)])
            reports = [p.finish_send().reports[0] for p in procs]
        finally:
            for p in procs:
                p.close()
        assert {Mode(r.mode).value for r in reports} == {mode} and all(r.nbytes > 0 for r in reports), reports
        assert all(r.prepared_ahead == ahead for r in reports), reports
        peer.verify(rid, ids, ROOM)
        for r in ranks:
            peer.release(1 + r)
        peer.free(rid)
        assert peer.available() == initial  # every page and staging slot back


@pytest.mark.parametrize("kind", ["mooncake", pytest.param("cuda-ipc", marks=pytest.mark.gpu)])
def test_one_prefill_rank_fans_out_into_every_decode_rank_at_once(kind):
    """TP 1 -> 2 from one sender process: on cuda-ipc as one fan-out (transfer.fanout: planned
    once, one launch, so every receiver's write starts at the same instant), over Mooncake a
    thread per receiver; either way every decode rank's heads byte-exact."""
    device, m, pages = ("cuda" if kind == "cuda-ipc" else "cpu"), 2, 4
    ids = np.random.default_rng(TOKENS).integers(0, 50000, TOKENS)
    peers = [PeerProcess(PRESET, pages, 4096, transport=kind, device=device, chunk_channels=2) for _ in range(m)]
    proc = None
    try:
        targets = []
        for s, peer in enumerate(peers):  # (fresh pools configured alike: they allocate the same pages)
            peer.configure(PRESET, pages, 1024, max_requests=2, staging_slots=4, device=device, tp=(m, s))
            rid, dst = peer.alloc(TOKENS)
            targets.append((rid, {c.value: dst[c].astype(np.int32).tobytes() for c in dst.components()}))
        proc = SenderProcess(
            PRESET, pages, TOKENS, (1, 0), seed=TOKENS, room=ROOM, mode="direct", device=device, transport=kind
        )
        proc.ready()
        sends = []
        for s, (peer, (rid, arrays)) in enumerate(zip(peers, targets)):
            proc.link(s, peer.target(), peer.channels[1])
            sends.append(SendTo(s, 1, arrays, peer.expect(1, rid, want_slots=2, sender=(pages, 1, 0))))
        proc.prepare(sends)  # (laid out ahead, as a worker does while the KV computes)
        proc.start_send(sends)
        reports = proc.finish_send().reports
        assert len(reports) == m and all(Mode(r.mode) is Mode.DIRECT and r.nbytes > 0 for r in reports), reports
        assert all(r.prepared_ahead for r in reports), reports
        if kind == "cuda-ipc":
            assert len({r.first_write_at for r in reports}) == 1, "one launch for every receiver"
        for peer, (rid, _) in zip(peers, targets):
            peer.verify(rid, ids, ROOM)
            peer.release(1)
            peer.free(rid)
    finally:
        if proc is not None:
            proc.close()
        for peer in peers:
            peer.close()
