"""Which prefill senders decode lends staging slots to, through the real control plane (servers
in this process, real ZMQ, Mooncake over TCP loopback): a sender that said at registration it
never stages (Registered.may_stage False: it gathers, TP 1 -> 2) is lent none and the request
never waits for one; a sender that may stage (TP 2 -> 1) still gets its own; an older prefill
that does not say is lent slots as before."""

import threading

import msgspec
import numpy as np
import pytest

from disagg.control.deadlines import Deadlines
from disagg.control.messages import Decoder, Registered, ToDecode, encoder
from disagg.decode.server import DecodeConfig, DecodeServer
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.pool_settings import PoolSettings
from kvpool import HybridPool
from transfer.config import TransferConfig

pytestmark = pytest.mark.slow

# All servers share this process: a stall of the whole process must not make one call another
# silent (no test here is about liveness).
DEAD_AFTER_S = 60.0
# Decode's wait for slots ends at the bootstrap deadline: far beyond what each test waits
# for a TransferRequest, so a request that waits for a slot fails the test, never passes late.
DEADLINES = Deadlines(bootstrap_s=120.0)
WAIT_S = 30.0


def _pool(tp_size: int, tp_rank: int) -> PoolSettings:
    return PoolSettings(
        preset="tiny-full", max_tokens=2048, max_requests=4, device="cpu", tp_size=tp_size, tp_rank=tp_rank
    )


def _prefills(tp: int) -> list[PrefillServer]:
    """A prefill instance of `tp` ranks, Mooncake only."""
    out: list[PrefillServer] = []
    for rank in range(tp):
        out.append(
            PrefillServer(
                PrefillConfig(
                    pool=_pool(tp, rank),
                    bootstrap_bind="tcp://127.0.0.1:*" if rank == 0 else None,
                    bootstrap_addr=out[0].bootstrap_endpoint if rank else None,
                    transports=("mooncake",),
                    dead_after_s=DEAD_AFTER_S,
                    deadlines=DEADLINES,
                )
            )
        )
    return out


def _decodes(prefills: list, tp: int, staging_slots: int) -> list[DecodeServer]:
    """A decode instance of `tp` ranks, each with `staging_slots` slots, Mooncake only (each
    registers with the prefill behind its bootstrap as it starts: its readiness watch)."""
    return [
        DecodeServer(
            DecodeConfig(
                pool=_pool(tp, rank),
                transfer=TransferConfig(staging_slots=staging_slots),
                bootstrap_addr=prefills[0].bootstrap_endpoint,
                transports=("mooncake",),
                dead_after_s=DEAD_AFTER_S,
                deadlines=DEADLINES,
            )
        )
        for rank in range(tp)
    ]


@pytest.fixture
def servers():
    """Whatever a test started, closed decodes first."""
    started: list = []
    yield started
    for server in reversed(started):
        server.close()


@pytest.fixture
def instances(request, servers):
    prefill_tp, decode_tp, staging_slots = request.param
    servers += _prefills(prefill_tp)
    prefills = list(servers)
    servers += _decodes(prefills, decode_tp, staging_slots)
    return prefills, servers[len(prefills) :]


def _asked(prefills: list, rooms: list[int], eventually) -> dict:
    """Once every decode rank's TransferRequest for every room is at every prefill rank: the
    staging slots each lent, per (room, prefill rank, decode rank)."""

    def arrived() -> bool:
        return all(
            (r := p.requests.get(room)) is not None and set(r.dests) == set(r.receivers)
            for room in rooms
            for p in prefills
        )

    eventually(arrived, WAIT_S, "every decode rank's TransferRequest (decode waiting for staging slots?)")
    return {
        (room, t, s): list(d.slots)
        for room in rooms
        for t, p in enumerate(prefills)
        for s, d in p.requests.get(room).dests.items()
    }


def _run(prefills: list, decodes: list, rooms: list[int], eventually) -> tuple[dict, dict]:
    """Every decode rank asks for every room first; once all have asked (the slots they lent
    read then), every prefill rank computes them. Returns (slots lent, decode answers)."""
    tokens, out = np.arange(300) % 97, {}
    asks = [
        threading.Thread(target=lambda d=d, s=s, room=room: out.__setitem__((room, s), d.decode(room, tokens, 2)))
        for room in rooms
        for s, d in enumerate(decodes)
    ]
    for t in asks:
        t.start()
    try:
        lent = _asked(prefills, rooms, eventually)
    finally:
        computes = [
            threading.Thread(target=lambda p=p, room=room: out.__setitem__(room, p.prefill(room, tokens)))
            for room in rooms
            for p in prefills
        ]
        for t in computes:
            t.start()
        for t in (*asks, *computes):
            t.join(WAIT_S)
    return lent, out


@pytest.mark.parametrize("instances", [(1, 2, 1)], indirect=True)
def test_a_sender_that_gathers_is_lent_no_slot_and_its_requests_never_wait_for_one(instances, eventually):
    """Issue 40: TP 1 -> 8 senders go gathered and never use a slot, yet decode lent them
    slots and made requests wait for them (16 slots: eight requests at a time per decode
    rank). Here every decode rank's only slot is held elsewhere the whole time: two
    concurrent requests TP 1 -> 2 still ask at once, lent nothing, and arrive gathered."""
    prefills, decodes = instances
    held = [d.endpoint.staging.lease.take(1, 0.0) for d in decodes]
    try:
        assert all(held)
        lent, out = _run(prefills, decodes, [41, 42], eventually)
    finally:
        for d, slots in zip(decodes, held):
            d.endpoint.staging.lease.release(slots)
    assert lent and all(s == [] for s in lent.values()), lent
    for room in (41, 42):
        assert out[room]["state"] == "SUCCESS", out[room]
        for s in range(2):
            got = out[(room, s)]
            assert got["state"] == "SUCCESS" and got["verified"] and got["mode"] == "gathered", got
            assert got["transport"] == "mooncake"
    for server in (*prefills, *decodes):
        assert server.available() == HybridPool(server.pool.config).available()
    assert all(d.endpoint.staging.lease.available() == 1 for d in decodes)


@pytest.mark.parametrize("instances", [(2, 1, 2)], indirect=True)
def test_senders_that_may_stage_still_get_slots_of_their_own(instances, eventually):
    """TP 2 -> 1: each sender holds half of decode's rows, so it may stage (AUTO weighs it):
    each is lent a slot of its own, and all come back."""
    prefills, decodes = instances
    lent, out = _run(prefills, decodes, [43], eventually)
    assert sorted(sum(lent.values(), [])) == [0, 1] and all(len(s) == 1 for s in lent.values()), lent
    got = out[(43, 0)]
    assert got["state"] == "SUCCESS" and got["verified"] and got["senders"] == 2, got
    assert decodes[0].endpoint.staging.lease.available() == 2


class _OldRegistered(msgspec.Struct, tag="Registered", frozen=True):
    """Registered as a prefill before may_stage sent it."""

    epoch: int
    transport: str = ""


def test_registered_decodes_both_ways_between_old_and_new_peers():
    """A new decode reads an old prefill's Registered as "may stage"; an old decode reads a
    new one's, the field it does not know ignored."""
    old = Decoder(ToDecode, "test").decode(encoder.encode(_OldRegistered(3, transport="mooncake")))
    assert old == Registered(3, transport="mooncake", may_stage=True)
    new = encoder.encode(Registered(4, transport="mooncake", may_stage=False))
    assert msgspec.msgpack.decode(new, type=_OldRegistered) == _OldRegistered(4, transport="mooncake")


def test_a_prefill_that_does_not_say_whether_it_stages_is_lent_slots_as_before(servers, eventually):
    """An older prefill answers Registered without may_stage: decode lends it slots as it
    always did (it cannot tell), and they come back unused once its gathered send is done."""
    servers += _prefills(1)
    prefills = list(servers)
    new = prefills[0].peers.register

    def register(identity, msg):
        reply = new(identity, msg)
        return _OldRegistered(reply.epoch, transport=reply.transport) if isinstance(reply, Registered) else reply

    prefills[0].peers.register = register  # before any decode registers (each does as it starts)
    servers += _decodes(prefills, 2, 1)
    decodes = servers[1:]
    lent, out = _run(prefills, decodes, [44], eventually)
    assert len(lent) == 2 and all(len(s) == 1 for s in lent.values()), lent
    for s in range(2):
        got = out[(44, s)]
        assert got["state"] == "SUCCESS" and got["verified"] and got["mode"] == "gathered", got
    assert all(d.endpoint.staging.lease.available() == 1 for d in decodes)
