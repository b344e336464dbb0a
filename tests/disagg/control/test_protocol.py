import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from disagg.control import layout as L
from disagg.control import messages as P
from disagg.errors import ProtocolError
from kvpool import HybridPool, Layout, PoolConfig, get_preset
from transfer.buffers import Buffer, buffers_of
from transfer.endpoint import StagingInfo
from transfer.report import TransferReport
from transfer.staging import Piece
from transfer.transports import Offer

LAYOUT = L.LayoutInfo(
    16, "page_major", [Buffer(0, 4096 * 10, 4096, "full", None, None), Buffer(1, 64 * 4, 64, "aux", None, None)]
)
DESCRIBED = L.LayoutInfo(16, "page_major", LAYOUT.buffers, L.describe_model(get_preset("tiny-hybrid")))
SAMPLES = [
    P.RegisterPrefill(P.PROTOCOL_VERSION, 0, 1, "tcp://10.0.0.1:5000", 42, LAYOUT),
    P.Lookup(P.PROTOCOL_VERSION, 0),
    P.PrefillInfo(P.RegisterPrefill(P.PROTOCOL_VERSION, 0, 1, "tcp://h:1", 1, LAYOUT)),
    P.RegisterDecode(
        P.PROTOCOL_VERSION, 9, LAYOUT, [Offer("mooncake", "10.0.0.2", b"opaque")], StagingInfo(2, 4, 1 << 20)
    ),
    P.RegisterDecode(P.PROTOCOL_VERSION, 9, LAYOUT, [], None),
    P.RegisterDecode(P.PROTOCOL_VERSION, 9, DESCRIBED, [], None),
    P.PrefillInfo(P.RegisterPrefill(P.PROTOCOL_VERSION, 0, 1, "tcp://h:1", 1, DESCRIBED)),
    P.TransferRequest(123, 9, 2048, {"full": np.arange(1, 5, dtype="<i4").tobytes()}, [0, 1]),
    P.TransferStarted(123, 42),
    P.TransferDone(
        123,
        42,
        True,
        "",
        TransferReport(
            mode="direct",
            transport="mooncake",
            nbytes=1 << 20,
            ranges=17,
            transfer_ms=3.5,
            streamed=True,
            groups=4,
            first_write_at=1e9,
        ),
    ),
    P.TransferDone(123, 42, False, "WriteFailed: boom", settled=False),
    P.Abort(123, "client cancelled"),
    P.Heartbeat(42),
    P.Registered(42),
    P.Registered(42, "mooncake"),
    P.Registered(42, "mooncake", may_stage=False),
    P.Refused("layout differs"),
    P.ChunkLanded(123, 0, 1, [Piece("full", 0, 0, 3, 0)]),
    P.ChunkDone(123, 0),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_its_socket_decoder(msg):
    unions = {
        "bootstrap-req": P.BootstrapRequest,
        "bootstrap-rep": P.BootstrapReply,
        "to-prefill": P.ToPrefill,
        "to-decode": P.ToDecode,
    }
    homes = [name for name, u in unions.items() if type(msg) in u.__args__]
    assert homes, f"{type(msg).__name__} belongs to no socket"
    for name in homes:
        assert P.Decoder(unions[name], name).decode(P.encoder.encode(msg)) == msg


@given(st.binary(max_size=300))
def test_random_frames_never_escape_as_anything_but_protocol_error(frame):
    for union in (P.BootstrapRequest, P.BootstrapReply, P.ToPrefill, P.ToDecode):
        try:
            P.Decoder(union, "x").decode(frame)
        except ProtocolError:
            pass


def test_oversized_and_wrong_type_frames():
    d = P.Decoder(P.ToPrefill, "control")
    with pytest.raises(ProtocolError, match="exceeds"):
        d.decode(b"\0" * (P.MAX_FRAME_BYTES + 1))
    with pytest.raises(ProtocolError, match="undecodable"):
        d.decode(P.encoder.encode(P.Lookup(1)))  # a bootstrap message on the control socket
    with pytest.raises(ProtocolError, match="undecodable"):
        d.decode(msgspec.msgpack.encode({"type": "TransferRequest", "room": "x"}))


def test_version_check():
    P.check_version(P.PROTOCOL_VERSION)
    with pytest.raises(ProtocolError, match="protocol version 99"):
        P.check_version(99)


def test_indices_travel_as_raw_int32_and_junk_is_refused():
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=2))
    iset = pool.index_set(pool.alloc_request(30))
    raw = P.indices_to_wire(iset)
    assert all(isinstance(v, bytes) for v in raw.values())
    back = P.indices_from_wire(raw)
    for c in iset.components():
        assert back[c].dtype == np.int32 and np.array_equal(back[c], iset[c]) and not back[c].flags.writeable
    with pytest.raises(ProtocolError, match="whole number"):
        P.indices_from_wire({"full": b"\1\2\3"})
    with pytest.raises(ProtocolError, match="unknown component"):
        P.indices_from_wire({"kv": b""})


def test_layout_difference_names_it():
    a = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=2))
    b = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 8, max_tokens=256, max_requests=2))
    c = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=2, layout=Layout.LAYER_MAJOR))
    d = HybridPool(PoolConfig(get_preset("tiny-mamba"), 4, max_tokens=256, max_requests=2))
    info = lambda p: L.LayoutInfo(p.page_size, p.config.layout.value, buffers_of(p.buffer_descriptors()))  # noqa: E731
    assert L.layout_difference(info(a), info(a)) is None
    assert "page size: prefill 4, decode 8" in L.layout_difference(info(a), info(b))
    assert "pool layout: prefill page_major, decode layer_major" in L.layout_difference(info(a), info(c))
    # no model descriptions (a peer that sends none): the words fall back to the buffers
    assert "component sets differ" in L.layout_difference(info(a), info(d))
    e = HybridPool(PoolConfig(get_preset("tiny-full"), 4, max_tokens=256, max_requests=2, tp_size=2))
    f = HybridPool(PoolConfig(get_preset("tiny-full"), 4, max_tokens=256, max_requests=2))
    assert "B/item" in L.layout_difference(info(e), info(f))


def test_buffers_and_staging_in_a_registration_are_validated_when_decoded():
    d = P.Decoder(P.ToPrefill, "control")
    good = P.RegisterDecode(P.PROTOCOL_VERSION, 1, LAYOUT, [], StagingInfo(2, 4, 4096))
    assert d.decode(P.encoder.encode(good)) == good
    raw = msgspec.msgpack.decode(P.encoder.encode(good))
    for field, bad in (
        ("layout", [16, "page_major", [[0, 8000, 4096, "full", None, None]]]),
        ("layout", [16, "page_major", [[0, 8192, 4096, "kv", None, None]]]),
        ("layout", [16, "page_major", [[-1, 8192, 4096, "full", None, None]]]),
        ("staging", [2, 0, 4096]),
    ):
        with pytest.raises(ProtocolError, match="undecodable"):
            d.decode(msgspec.msgpack.encode({**raw, field: bad}))


def test_a_transfer_report_in_a_transfer_done_is_validated_when_decoded():
    """The report is the prefill's word: a count or time it cannot be refuses the message."""
    d = P.Decoder(P.ToDecode, "control")
    good = P.TransferDone(1, 2, True, report=TransferReport(mode="staged", nbytes=64, chunks=1, ranges=2))
    assert d.decode(P.encoder.encode(good)) == good
    raw = msgspec.msgpack.decode(P.encoder.encode(good))
    for bad in ({"bytes": -1}, {"transfer_ms": -2.0}, {"ranges": "many"}, {"mode": 3}):
        with pytest.raises(ProtocolError, match="undecodable"):
            d.decode(msgspec.msgpack.encode({**raw, "report": {**raw["report"], **bad}}))
