"""The sending side of a conformance test: a pool configured like the receiver's, its bytes
random, both sides' free pages shuffled so every request is fragmented."""

import os

import numpy as np

from harness.peer_client import LocalPeer
from kvpool import HybridPool, Layout, PoolConfig, get_preset

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
