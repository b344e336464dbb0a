"""Fuzzing every socket of a running stack (hypothesis): router and worker HTTP with random
JSON bodies and raw bytes, the prefill's control socket with random and well-formed but
hostile messages. Nothing may answer 500 or crash; the stack then serves a real request and
both pools are back to their initial free counts."""

import json
import socket
import urllib.parse
import urllib.request

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg.control import messages as P
from disagg.tools.launcher import Launcher
from disagg.router.router import post_json
from fault_stack import inflight, pool_free

pytestmark = pytest.mark.slow
QUICK = ["--bootstrap-timeout", "1", "--waiting-timeout", "1", "--transfer-timeout", "2"]
COMMON = ["--preset", "tiny-full", "--device", "cpu", "--max-tokens", "8192", "--max-requests", "8"]
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

scalars = (
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False) | st.text(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
small_ints = st.integers(-3, 3000)
fields = st.sampled_from(
    ["prompt_len", "token_ids", "max_new_tokens", "seed", "request_id", "room", "reason", "bootstrap", "x"]
)
bodies = st.dictionaries(fields, values | small_ints | st.lists(small_ints, max_size=30), max_size=5)


@pytest.fixture(scope="module")
def stack(keyed):
    with Launcher() as launcher:
        prefill = launcher.start("prefill", *COMMON, *QUICK, "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start(
            "decode", *COMMON, *QUICK, "--quarantine", "2", "--bootstrap-addr", prefill["bootstrap"]
        )
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        initial = pool_free(prefill["http"]), pool_free(decode["http"])
        yield {"prefill": prefill, "decode": decode, "router": router["http"], "initial": initial, "gate": keyed}


def _serves_and_nothing_leaked(stack) -> None:
    out = post_json(stack["router"] + "/generate", {"prompt_len": 77}, 60)
    assert out["ok"] and out["verified"], out


def _post_raw(url: str, body: bytes) -> int:
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            json.loads(resp.read())
            return resp.status
    except urllib.error.HTTPError as exc:
        json.loads(exc.read())  # every refusal is a JSON error, not a stack trace
        return exc.code


@FUZZ
@given(body=bodies, path=st.sampled_from(["/generate", "/abort"]))
def test_router_http(stack, body, path):
    assert _post_raw(stack["router"] + path, json.dumps(body).encode()) in (200, 400, 503)


@FUZZ
@given(body=bodies, role=st.sampled_from(["prefill", "decode"]), route=st.sampled_from(["work", "/abort"]))
def test_worker_http(stack, body, role, route):
    path = ("/prefill" if role == "prefill" else "/decode") if route == "work" else route
    assert _post_raw(stack[role]["http"] + path, json.dumps(body).encode()) in (200, 400, 409, 503)


@FUZZ
@given(data=st.binary(max_size=400), target=st.sampled_from(["router", "prefill", "decode"]))
def test_raw_bytes_on_http_ports(stack, data, target):
    url = urllib.parse.urlsplit(stack[target] if target == "router" else stack[target]["http"])
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(4096):  # the server answers or closes; it never hangs
            pass


def _layout(stack) -> P.LayoutInfo:
    from disagg.bootstrap.server import BootstrapClient

    client = BootstrapClient(stack["prefill"]["bootstrap"], stack["gate"])
    try:
        return client.lookup(P.PROTOCOL_VERSION).layout
    finally:
        client.close()


def _fake_decode(layout: P.LayoutInfo, layout_override: P.LayoutInfo | None = None) -> P.RegisterDecode:
    """A registration from a decode that does not exist: the prefill's own layout, a Mooncake
    offer naming a closed port and made-up regions (prefill connects lazily; writes fail)."""
    import msgspec
    from transfer.transports import Offer
    from transfer.transports.mooncake import _Blob

    blob = _Blob("127.0.0.1:9", [((1 << 40) + (i << 34), b.nbytes) for i, b in enumerate(layout.buffers)])
    return P.RegisterDecode(
        P.PROTOCOL_VERSION,
        1,
        layout_override or layout,
        [Offer("mooncake", "127.0.0.1", msgspec.msgpack.encode(blob))],
        None,
    )


room_ids = st.integers(0, (1 << 62) - 1)
index_bytes = st.binary(max_size=64) | st.lists(st.integers(-(1 << 31), (1 << 31) - 1), max_size=16).map(
    lambda xs: b"".join(x.to_bytes(4, "little", signed=True) for x in xs)
)
messages = st.one_of(
    st.builds(
        P.TransferRequest,
        room_ids,
        st.integers(0, 1 << 62),
        st.integers(-5, 1 << 20),
        st.dictionaries(st.sampled_from(["full", "aux", "swa", "bogus"]), index_bytes, max_size=3),
        st.lists(st.integers(-5, 100), max_size=4),
        st.integers(-(1 << 40), 1 << 40) | st.sampled_from([0, 4, 16]),
    ),
    st.builds(P.Abort, room_ids, st.text(max_size=30)),
    st.builds(P.Heartbeat, st.integers(0, 1 << 62)),
    st.builds(P.TransferDone, room_ids, st.integers(0, 1 << 62), st.booleans()),
)


@FUZZ
@given(
    frames=st.lists(
        st.lists(messages.map(P.encoder.encode) | st.binary(max_size=200), min_size=1, max_size=3),
        min_size=1,
        max_size=6,
    ),
    register=st.booleans(),
)
def test_control_socket(stack, frames, register):
    """A fake decode (registered with the prefill's own layout and a dead transport, or not at all)
    sends hostile frames; prefill answers each with a refusal or nothing, never writes."""
    sock = stack["gate"].client(stack["gate"].ctx.socket(zmq.DEALER), "fuzzing dealer")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack["prefill"]["control"])
    try:
        if register:
            sock.send(P.encoder.encode(_fake_decode(_layout(stack))))
            assert sock.poll(10_000)
            assert isinstance(P.Decoder(P.ToDecode, "t").decode(sock.recv()), (P.Registered, P.Refused))
        decoder = P.Decoder(P.ToDecode, "test")
        for parts in frames:  # single frames and multi-part messages
            sock.send_multipart(parts)
        sock.send(P.encoder.encode(P.Heartbeat(1)))  # the socket still answers after all that
        while True:
            assert sock.poll(10_000), "prefill stopped answering"
            reply = decoder.decode(sock.recv())
            if isinstance(reply, P.Heartbeat) or (isinstance(reply, P.Refused) and "register" in reply.reason):
                break
    finally:
        sock.close()


@pytest.mark.parametrize(
    "role,path,body",
    [
        ("decode", "/decode", {"room": 1 << 64, "token_ids": [1]}),  # beyond int64: once killed the I/O thread
        ("prefill", "/prefill", {"room": -1, "token_ids": [1]}),
        ("decode", "/abort", {"room": 1 << 63}),
        ("prefill", "/prefill", {"room": 5, "token_ids": [[1, 2], [3, 4]]}),
        ("decode", "/decode", {"room": 5, "token_ids": [1 << 40]}),
        ("decode", "/decode", {"room": 5, "token_ids": [1], "bootstrap": "garbage"}),  # was a ZMQError: 500
        ("decode", "/decode", {"room": 5, "token_ids": [1], "bootstrap": "tcp://127.0.0.1:99999"}),
    ],
)
def test_out_of_range_fields_are_refused(stack, role, path, body):
    assert _post_raw(stack[role]["http"] + path, json.dumps(body).encode()) == 400


def test_a_malformed_layout_in_a_registration_is_refused(stack):
    sock = stack["gate"].client(stack["gate"].ctx.socket(zmq.DEALER), "fuzzing dealer")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack["prefill"]["control"])
    try:
        layout = _layout(stack)
        from msgspec.structs import replace

        bad = P.LayoutInfo(
            layout.page_size,
            layout.layout,
            [replace(b, item_bytes=2 * b.item_bytes, nbytes=2 * b.nbytes) for b in layout.buffers],
        )
        sock.send(P.encoder.encode(_fake_decode(layout, bad)))
        assert sock.poll(10_000)
        reply = P.Decoder(P.ToDecode, "t").decode(sock.recv())
        assert isinstance(reply, P.Refused) and "layout mismatch" in reply.reason
    finally:
        sock.close()


def test_after_the_fuzzing_both_pools_are_back(stack, eventually):
    eventually(
        lambda: (
            (pool_free(stack["prefill"]["http"]), pool_free(stack["decode"]["http"])) == stack["initial"]
            and inflight(stack["prefill"]["http"]) == 0
            and inflight(stack["decode"]["http"]) == 0
        ),
        30,
        "both pools back to their initial free counts",
    )
    _serves_and_nothing_leaked(stack)


@pytest.mark.parametrize("role,path", [("router", "/generate"), ("prefill", "/prefill"), ("decode", "/decode")])
def test_deeply_nested_json_is_a_400_not_a_traceback(stack, role, path):
    """Issue 17, defect 5: 100,000 nested brackets raised RecursionError (HTTP 500) everywhere."""
    url = stack["router"] if role == "router" else stack[role]["http"]
    assert _post_raw(url + path, b"[" * 100_000 + b"]" * 100_000) == 400
    _serves_and_nothing_leaked(stack)
