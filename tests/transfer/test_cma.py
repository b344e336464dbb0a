"""The cma transport between two real processes: a writer here, the owner of two CPU regions
in a process of its own (harness/cma_owner.py). Bytes land where the ranges say and nowhere
else; what the writer may reach is what the owner's own socket answers, never an address or a
pid in the offer; a range outside the owner's regions, a gone owner and a closed link are
refused before a byte moves; pick() takes the next offer where cma cannot reach."""

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from harness import memory
from harness.processes import reap, spawn
from transfer.errors import OutOfBounds, PeerUnreachable, TransportError
from transfer.transports import Offer, Ranges, TransportSettings, create, pick
from transfer.transports.cma import KIND, _Blob

SIZE = 1 << 16
ROOT = Path(__file__).resolve().parents[2]


class Owner:
    def __init__(self):
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
        self.proc = spawn(
            [sys.executable, "-m", "harness.cma_owner", str(SIZE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        line = json.loads(self.proc.stdout.readline())
        self.offer = Offer(line["kind"], line["host"], bytes.fromhex(line["blob"]))

    def dump(self) -> bytes:
        self.proc.stdin.write("dump\n")
        self.proc.stdin.flush()
        return bytes.fromhex(json.loads(self.proc.stdout.readline())["hex"])

    def end(self) -> None:
        reap(self.proc, wait_s=10)


@pytest.fixture
def owner():
    o = Owner()
    yield o
    o.end()


@pytest.fixture
def writer():
    """(cma transport, exposure of a local region of bytes 0xA0.., the region)."""
    [t] = create([KIND], TransportSettings())
    src = ctypes.create_string_buffer(bytes((0xA0 + i) % 256 for i in range(SIZE)), SIZE)
    exposure = t.expose([(ctypes.addressof(src), SIZE)])
    yield t, exposure, src
    exposure.close()


def _before() -> bytes:
    pattern = bytes(i % 251 for i in range(SIZE))
    return pattern + pattern[::-1]


def test_bytes_land_where_the_ranges_say_and_nowhere_else(owner, writer):
    t, exposure, src = writer
    assert t.reach_problem(owner.offer) is None
    link = t.connect(owner.offer, exposure)
    ranges = Ranges(*(np.array(v, dtype=np.int64) for v in ([0, 0], [100, 5000], [0, 1], [7, 60000], [300, 4000])))
    link.write_async(ranges).wait()
    want = bytearray(_before())
    want[7:307] = src.raw[100:400]
    want[SIZE + 60000 : SIZE + 64000] = src.raw[5000:9000]
    assert owner.dump() == bytes(want)
    link.close()


def test_a_range_outside_the_owners_regions_is_refused_before_a_byte_moves(owner, writer):
    t, exposure, _ = writer
    link = t.connect(owner.offer, exposure)
    with pytest.raises(OutOfBounds, match="destination pid"):  # the second range ends one byte past region 1
        link.write_async(
            Ranges(*(np.array(v, dtype=np.int64) for v in ([0, 0], [0, 0], [0, 1], [0, SIZE - 9], [8, 10])))
        )
    assert owner.dump() == _before()
    link.close()


def test_a_gone_owner_and_a_closed_link_refuse_writes(writer):
    t, exposure, _ = writer
    gone, closing = Owner(), Owner()
    try:
        link = t.connect(gone.offer, exposure)
        gone.end()
        with pytest.raises(PeerUnreachable, match="the process that owns the memory is gone"):
            link.write_async(Ranges.one(0, 0, 0, 0, 16))
        with pytest.raises(PeerUnreachable):
            link.probe()
        assert "does not answer here" in t.reach_problem(gone.offer)
        link.close()
        other = t.connect(closing.offer, exposure)
        other.close()
        with pytest.raises(PeerUnreachable, match="the link is closed"):
            other.write_async(Ranges.one(0, 0, 0, 0, 16))
        assert closing.dump() == _before()
    finally:
        closing.end()


def test_an_offer_names_a_socket_of_ours_on_this_host_or_nothing(owner, writer):
    """No address or pid travels: what is reached is the process that answers on the socket
    (SO_PEERCRED) and the regions it answers. Anything else in an offer is refused."""
    t, exposure, _ = writer
    name = msgspec.msgpack.decode(owner.offer.blob, type=_Blob).socket
    elsewhere = Offer(KIND, "another-boot/another-host", owner.offer.blob)
    assert "another host" in t.reach_problem(elsewhere)
    for blob, why in (
        (b"\x93\x01\x02\x03", "malformed"),
        (msgspec.msgpack.encode(_Blob(b"\0someone-else")), "not one of our sockets"),
        (msgspec.msgpack.encode(_Blob(name + b"x")), "does not answer here"),
    ):
        assert why in t.reach_problem(Offer(KIND, owner.offer.host, blob))
        with pytest.raises(TransportError, match=why):
            t.connect(Offer(KIND, owner.offer.host, blob), exposure)
    assert owner.dump() == _before()


def test_pick_takes_the_next_offer_where_cma_cannot_reach(writer):
    """A receiver offers cma first and a transport that reaches other hosts second (disagg.vllm:
    mooncake; here the harness's memory transport): an owner whose socket does not answer (gone,
    another network namespace) is reached over the second."""
    memory.register()
    t, _, _ = writer
    [mem] = create(["memory"], TransportSettings())
    region = ctypes.create_string_buffer(16)
    theirs = mem.expose([(ctypes.addressof(region), 16)])
    gone = Owner()
    gone.end()
    offer, transport = pick([gone.offer, theirs.offer()], [t, mem])
    assert (offer.kind, transport) == ("memory", mem)
