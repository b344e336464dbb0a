"""How a Mooncake write is waited for (transports/mooncake.py MooncakeWrite.wait): sleeps that
double from POLL_INTERVAL_S to POLL_MAX_S while no range lands, and start over once one does.
A prefill rank of TP 1 -> 8 waits on eight 16 MiB staged chunks at once; polled every 100 us
they took a third of its CPU on two cores (issue 40). Real engine, receiver in another process;
the sleeps are recorded, not timed."""

import time
import types

import pytest

from harness.peer_client import PeerProcess
from harness.source import source_pool
from kvpool import Layout
from transfer.config import TransferConfig
from transfer.endpoint import PoolEndpoint
from transfer.sender import KVSender
from transfer.transports import Ranges
from transfer.transports import mooncake as mc

SLOT = 16 << 20


@pytest.fixture(scope="module")
def link(mooncake):
    """A link to a peer process whose staging area is 4 x 16 MiB, and our staging area of as much."""
    with PeerProcess("tiny-full", 16, 1024) as peer:
        pool = source_pool(peer, "tiny-full", 16, Layout.PAGE_MAJOR)
        peer.configure("tiny-full", 16, 1024, staging_slots=4, staging_slot_mib=SLOT >> 20)
        with PoolEndpoint(mooncake, pool, TransferConfig(staging_slots=4, staging_slot_bytes=SLOT)) as endpoint:
            target = KVSender(endpoint).connect(*(lambda t: (t.offers, t.buffers, t.staging))(peer.target()))
            yield endpoint, target


def _sleeps(monkeypatch) -> tuple[list[tuple[float, int]], list]:
    """(interval, ranges the write had retired then) per sleep of the write in `box[0]`."""
    sleeps, box = [], []

    def sleep(s: float) -> None:
        sleeps.append((s, getattr(box[0], "_retired", None)))
        time.sleep(s)

    monkeypatch.setattr(mc, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    return sleeps, box


def test_a_write_that_lands_late_is_polled_less_and_less_often(link, monkeypatch):
    endpoint, target = link
    sleeps, box = _sleeps(monkeypatch)
    box.append(
        target.link.write_async(Ranges.one(endpoint.staging_region, 0, target.staging.region, 0, 4 * SLOT))
    )  # one range of 64 MiB: nothing retires until it all landed
    box[0].wait()
    intervals = [s for s, _ in sleeps]
    assert len(intervals) >= 3, f"64 MiB over TCP landed within {len(intervals)} polls"
    want = [min(mc.MooncakeWrite.POLL_INTERVAL_S * 2**i, mc.MooncakeWrite.POLL_MAX_S) for i in range(len(intervals))]
    assert intervals == pytest.approx(want)


def test_the_sleep_starts_over_after_a_poll_that_retired_a_range(link, monkeypatch):
    endpoint, target = link
    sleeps, box = _sleeps(monkeypatch)
    n, size = 512, 64 << 10  # ranges land one after another
    box.append(
        target.link.write_async(
            Ranges.concat(
                [Ranges.one(endpoint.staging_region, i * size, target.staging.region, i * size, size) for i in range(n)]
            )
        )
    )
    box[0].wait()
    assert box[0]._retired == n
    first, prev_retired = mc.MooncakeWrite.POLL_INTERVAL_S, 0
    for k, (interval, retired) in enumerate(sleeps):
        if k == 0 or retired != prev_retired:
            assert interval == pytest.approx(first), f"sleep {k}: {interval} s after a range landed"
        else:
            assert interval == pytest.approx(min(2 * sleeps[k - 1][0], mc.MooncakeWrite.POLL_MAX_S))
        prev_retired = retired
