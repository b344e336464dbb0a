"""The forged-decode attack (issue 17, defect 1) against real processes with auth on: a peer
without the deployment's key cannot register with prefill, and decode cannot be made to send
its registration to a bootstrap a client names."""

import json
import urllib.error
import urllib.request

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from disagg.bootstrap.server import BootstrapClient
from disagg.control import messages as P
from disagg.router.router import post_json
from disagg.tools.launcher import Launcher
from fault_stack import inflight, pool_free
from transfer.transports import Offer
from transfer.transports.mooncake import _Blob

pytestmark = pytest.mark.slow
COMMON = ["--preset", "tiny-full", "--device", "cpu", "--max-tokens", "8192", "--max-requests", "8"]


@pytest.fixture(scope="module")
def stack(keyed):
    with Launcher() as launcher:
        prefill = launcher.start("prefill", *COMMON, "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start("decode", *COMMON, "--bootstrap-addr", f"main={prefill['bootstrap']}")
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},main")
        client = BootstrapClient(prefill["bootstrap"], keyed, timeout_s=10)
        layout = client.lookup(P.PROTOCOL_VERSION).layout
        client.close()
        yield {
            "prefill": prefill,
            "decode": decode,
            "router": router["http"],
            "layout": layout,
            "initial": (pool_free(prefill["http"]), pool_free(decode["http"])),
        }


def _forged(layout: P.LayoutInfo) -> bytes:
    """A RegisterDecode as the attacker built it: the real layout, regions it made up."""
    blob = _Blob("127.0.0.1:9", [((1 << 40) + (i << 34), b.nbytes) for i, b in enumerate(layout.buffers)])
    return P.encoder.encode(
        P.RegisterDecode(
            P.PROTOCOL_VERSION, 1, layout, [Offer("mooncake", "127.0.0.1", msgspec.msgpack.encode(blob))], None
        )
    )


def _serves(stack) -> None:
    out = post_json(stack["router"] + "/generate", {"prompt_len": 99}, 60)
    assert out.get("ok") and out.get("verified"), out.get("reason", out)


@pytest.mark.parametrize("who", ["no CURVE", "a key of its own", "the deployment's key"])
def test_only_the_deployment_key_registers_with_prefill(stack, keyed, stranger, who):
    gate = {"a key of its own": stranger, "the deployment's key": keyed}.get(who)
    ctx = gate.ctx if gate else zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    if gate is not None:
        gate.client(sock, "attacker")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack["prefill"]["control"])
    try:
        sock.send(_forged(stack["layout"]))
        answered = sock.poll(3000)
        if who == "the deployment's key":  # a member of the deployment is heard (and bounded: docs/security.md)
            assert answered and isinstance(P.Decoder(P.ToDecode, "t").decode(sock.recv()), P.Registered)
        else:
            assert not answered, f"prefill answered a peer with {who}"
    finally:
        sock.close()
    _serves(stack)


def _decode_with(stack, bootstrap: str) -> tuple[int, dict]:
    body = json.dumps({"room": 12345, "token_ids": [1, 2, 3], "bootstrap": bootstrap}).encode()
    req = urllib.request.Request(stack["decode"]["http"] + "/decode", body, {"Content-Type": "application/json"})
    try:
        # (a room prefill never computes fails at decode's deadlines, the longest 30 s: wait past it)
        with urllib.request.urlopen(req, timeout=90) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("keyed_attacker", [False, True])
def test_decode_never_registers_with_a_bootstrap_a_client_names(stack, keyed, keyed_attacker):
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.REP)
    if keyed_attacker:
        keyed.server(fake, "fake bootstrap")
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    try:
        status, out = _decode_with(stack, f"tcp://127.0.0.1:{port}")
        assert status == 400 and "not one this decode is configured with" in out["error"], out
        assert not fake.poll(500), "decode looked a prefill up at the attacker's bootstrap"
    finally:
        fake.close()
    assert inflight(stack["decode"]["http"]) == 0


def test_requests_name_a_configured_bootstrap_by_name_or_address(stack):
    _serves(stack)  # the router's pair names it "main"
    for name in ("main", "default", stack["prefill"]["bootstrap"]):
        status, out = _decode_with(stack, name)
        assert status == 200 and out["state"] == "FAILED" and "not one" not in out.get("reason", ""), out


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.lists(st.binary(max_size=120), min_size=1, max_size=3), min_size=50, max_size=80))
def test_fuzzed_frames_from_a_peer_without_credentials_get_nothing(stack, batch):
    """Random single and multi-part frames at the bootstrap and the control socket from a peer
    without the key: not one answer, and the stack serves on."""
    ctx = zmq.Context.instance()
    socks = []
    for endpoint in (stack["prefill"]["bootstrap"], stack["prefill"]["control"]):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        socks.append(sock)
    try:
        for parts in batch:
            for sock in socks:
                try:  # a DEALER whose handshake was refused has no pipe: a blocking send would wait forever
                    sock.send_multipart(parts, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass
        assert not any(sock.poll(1000) for sock in socks), "a peer without credentials was answered"
    finally:
        for sock in socks:
            sock.close()
    _serves(stack)


def test_nothing_leaked(stack, eventually):
    eventually(
        lambda: (
            (pool_free(stack["prefill"]["http"]), pool_free(stack["decode"]["http"])) == stack["initial"]
            and inflight(stack["prefill"]["http"]) == 0
        ),
        30,
        "both pools back to their initial free counts",
    )
