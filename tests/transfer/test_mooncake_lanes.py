"""Mooncake TCP's receive lanes (transfer.transports.mooncake, "Receive lanes"): a transport
runs several engines, its offer names every engine's session, and a link on lane L leaves from
our engine L mod ours and lands in the peer's engine L mod theirs. Real engines: each write's
bytes are read back from the receiver's memory. (Resharded sends through lanes, into a
receiver in another process: tests/transfer/test_reshard.py, whose transports run the default
engines.)"""

import argparse

import msgspec
import numpy as np
import pytest

from harness import memory
from kvpool import HybridPool, PoolConfig, get_preset
from transfer.config import TransferConfig
from transfer.endpoint import PoolEndpoint
from transfer.errors import TransportError
from transfer.sender import KVSender
from transfer.transports import TRANSPORTS, Offer, Ranges, TransportSettings, create
from transfer.transports.mooncake import ENGINES_TCP, MAX_LANES, MooncakeSettings, MooncakeTransport, _Blob


@pytest.fixture(scope="module")
def pair():
    """A receiver of three engines and a sender of two (as a decode rank and a prefill rank)."""
    return MooncakeTransport(engines=3), MooncakeTransport(engines=2)


def _exposed(transport, nbytes: int, fill: int):
    buf = np.full(nbytes, fill, dtype=np.uint8)
    return buf, transport.expose([(buf.ctypes.data, buf.nbytes)])


def test_every_lane_lands_its_bytes_through_the_engines_it_names(pair):
    receiver, sender = pair
    dst, theirs = _exposed(receiver, 1 << 20, 0)
    src, ours = _exposed(sender, 1 << 20, 0)
    src[:] = np.arange(src.size) % 251
    offer = theirs.offer()
    assert len(set(receiver.sessions)) == 3 and receiver.session_id == receiver.sessions[0]
    for lane in range(6):  # wraps: 6 lanes over 3 engines there and 2 here
        link = sender.connect(offer, ours, lane)
        assert (link.engine, link.peer) == (lane % 2, receiver.sessions[lane % 3])
        at = lane * (128 << 10)
        link.write_async(Ranges.one(0, at, 0, at, 128 << 10)).wait(timeout=10)
        link.probe()
        link.close()
    assert np.array_equal(dst[: 6 * (128 << 10)], src[: 6 * (128 << 10)])
    assert not dst[6 * (128 << 10) :].any(), "a lane wrote outside its range"
    ours.close(), theirs.close()


def test_a_session_met_under_another_incarnation_is_written_from_a_spare_engine():
    """An offer at a session that one of our engines wrote to under another incarnation (a
    restarted peer on a dead one's ports: tests/transfer/test_restarted_peers.py meets it for
    real): that engine's cache of the session is stale, so the link leaves from a spare
    engine that holds every region registered and is offered to no one; the first
    incarnation keeps its engine."""
    receiver, sender = MooncakeTransport(engines=1), MooncakeTransport(engines=1)
    dst, theirs = _exposed(receiver, 1 << 16, 0)
    src, ours = _exposed(sender, 1 << 16, 0)
    src[:] = np.arange(src.size) % 251
    first = theirs.offer()
    blob = msgspec.msgpack.decode(first.blob, type=_Blob)
    assert blob.incarnation == receiver.incarnation != 0
    other = msgspec.structs.replace(blob, incarnation=blob.incarnation ^ 2)
    again = Offer(first.kind, first.host, msgspec.msgpack.encode(other))
    assert sender.connect(first, ours).engine == 0
    link = sender.connect(again, ours)
    assert (link.engine, link.peer, len(sender.engines)) == (1, receiver.session_id, 2)
    link.write_async(Ranges.one(0, 0, 0, 0, 1 << 16)).wait(timeout=10)
    assert np.array_equal(dst, src)
    assert [sender.connect(o, ours).engine for o in (first, again)] == [0, 1]
    assert msgspec.msgpack.decode(ours.offer().blob, type=_Blob).sessions == sender.sessions == [sender.session_id]
    ours.close(), theirs.close()  # (unregistered from the spare too)


def test_an_offer_of_one_session_takes_every_lane():
    """An older peer (one engine) offers no lanes: every lane lands in its one engine (and,
    offering no incarnation, it is met as one peer: no spare engine starts)."""
    receiver, sender = MooncakeTransport(engines=1), MooncakeTransport(engines=2)
    dst, theirs = _exposed(receiver, 4096, 0)
    src, ours = _exposed(sender, 4096, 7)
    blob = msgspec.msgpack.decode(theirs.offer().blob, type=_Blob)
    old = msgspec.msgpack.encode([blob.session, blob.regions])  # what a one-engine peer encodes
    for lane in (0, 1, 5):
        link = sender.connect(Offer("mooncake", receiver.host, old), ours, lane)
        assert link.peer == receiver.sessions[0]
        link.write_async(Ranges.one(0, 0, 0, 0, 4096)).wait(timeout=10)
    assert (dst == 7).all() and len(sender.engines) == 2
    ours.close(), theirs.close()


@pytest.mark.parametrize(
    "lanes,message",
    [
        (["127.0.0.1"], "session '127.0.0.1'"),
        (["127.0.0.1:99999"], "session '127.0.0.1:99999'"),
        ([":17000"], "session ':17000'"),
        ([f"127.0.0.1:{15000 + i}" for i in range(MAX_LANES)], f"at most {MAX_LANES}"),
    ],
)
def test_an_offer_naming_a_bad_session_or_too_many_is_refused(pair, lanes, message):
    receiver, sender = pair
    _, ours = _exposed(sender, 4096, 0)
    blob = msgspec.msgpack.encode(_Blob(receiver.sessions[0], [(4096, 4096)], lanes))
    with pytest.raises(TransportError, match=message):
        sender.connect(Offer("mooncake", receiver.host, blob), ours, 1)
    ours.close()


def test_the_engine_count_is_a_flag_checked_where_it_is_parsed():
    parser = argparse.ArgumentParser()
    TRANSPORTS.add_flags(parser)
    own = TransportSettings(own=TRANSPORTS.own_settings(parser.parse_args(["--mooncake-engines", "2"])))
    assert own.of(MooncakeSettings) == MooncakeSettings(engines=2)
    for bad in ("-1", "65", "two"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--mooncake-engines", bad])
    with pytest.raises(TransportError, match="several engines are for tcp"):
        MooncakeSettings("rdma", engines=4)
    assert MooncakeSettings("rdma").engines == 0  # the default: one engine there


def test_the_default_count_and_an_asked_for_count_of_engines_start():
    [t] = create(["mooncake"], TransportSettings("127.0.0.1"))
    assert len(t.engines) == ENGINES_TCP == len(set(t.sessions))
    [four] = create(["mooncake"], TransportSettings("127.0.0.1", own=(MooncakeSettings(engines=4),)))
    assert len(four.engines) == 4 == len(set(four.sessions))


def test_a_sender_connects_on_the_lane_of_its_rank_plus_the_receivers():
    """TP 4 -> 1: prefill rank r lands on lane r (so on r mod engines of the decode rank);
    TP 1 -> 2: a prefill rank's decode rank s leaves on lane s."""
    model = get_preset("tiny-swa")

    def pool(tp):
        return HybridPool(PoolConfig(model, 4, max_tokens=256, max_requests=2, tp_size=tp[0], tp_rank=tp[1]))

    for ours, theirs, lane in (((2, 1), (1, 0), 1), ((1, 0), (2, 1), 1), ((2, 0), (1, 0), 0)):
        mem = memory.MemoryTransport()
        with (
            PoolEndpoint(mem, pool(ours), TransferConfig()) as endpoint,
            PoolEndpoint(memory.MemoryTransport(), pool(theirs), TransferConfig()) as receiver,
        ):
            KVSender(endpoint).connect(receiver.offers(), receiver.buffers, receiver.staging_info(), 4, theirs)
        assert mem.lanes == [lane], (ours, theirs)
