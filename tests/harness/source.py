"""The sending side of a conformance test: a pool configured like the receiver's, its bytes
random, both sides' free pages shuffled so every request is fragmented."""

import os

import numpy as np

from harness.peer_client import LocalPeer
from harness.peer_server import digest_request, digest_tokens
from kvpool import HybridPool, Layout, PoolConfig, get_preset
from transfer.config import TransferConfig
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender
from transfer.staging import RemoteSlots

DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cpu")  # both sides' pools and staging areas


def device_for(peer) -> str:
    """The memory transport copies host memory; cuda-ipc needs CUDA pools (DISAGG_TEST_DEVICE=cuda)."""
    return "cpu" if isinstance(peer, LocalPeer) else DEVICE


def source_pool(
    peer,
    preset: str,
    page: int,
    layout: Layout,
    tokens: int = 2048,
    fragment: bool = True,
    peer_page: int | None = None,
) -> HybridPool:
    """Reconfigure `peer` (pages of `peer_page`, default `page`) and return a matching sender
    pool of random bytes."""
    peer.configure(
        preset,
        peer_page or page,
        tokens,
        layout=layout.value,
        max_requests=4,
        staging_slots=4,
        staging_slot_mib=1,
        device=device_for(peer),
    )
    pool = HybridPool(
        PoolConfig(get_preset(preset), page, max_tokens=tokens, max_requests=4, layout=layout, device=device_for(peer))
    )
    if fragment:
        np.random.default_rng(0).shuffle(pool.pages._stack[: pool.pages.num_free])
        peer.fragment(1)
    for p in pool.pools.values():
        for b in p.storage.buffers:
            b.random_(0, 256)
    return pool


def send_checked(transport, peer, pool, tokens, mode, transfer_id=1, by_token=False, chunk_bytes=0):
    """One request, checked byte for byte (by_token: per token position, for pools of
    different page sizes) and for bytes written outside it."""
    config = TransferConfig(mode=mode, staging_slot_bytes=1 << 20, staging_chunk_bytes=chunk_bytes)
    with PoolEndpoint(transport, pool, config) as endpoint:
        sender = KVSender(endpoint)
        target = peer.connect(sender)
        req = pool.alloc_request(tokens)
        rid, dst = peer.alloc(tokens)
        before = peer.digest(rid, outside=True).outside
        slots = peer.expect(transfer_id, rid, want_slots=2)
        report = sender.send(
            target, pool.index_set(req), dst, RemoteSlots(transfer_id, slots, peer.channel), num_tokens=req.num_tokens
        )
        got = peer.digest(rid, outside=True, by_token=by_token)
        peer.release(transfer_id)
        assert got.per_component == (digest_tokens if by_token else digest_request)(pool, req), "bytes differ"
        assert got.outside == before, "bytes outside the request changed"
        peer.free(rid)
        pool.free_request(req)
        return report
