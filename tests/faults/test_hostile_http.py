"""HTTP that cannot be starved (issue 17, defects 4 and 7): connections that send half a
request, too many connections, and a client that half-closes after sending, against real
router/prefill/decode processes."""

import json
import socket
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from disagg.api.server import READ_TIMEOUT_S
from disagg.router.router import post_json
from disagg.tools.launcher import Launcher
from fault_stack import inflight, pool_free

pytestmark = pytest.mark.slow
DECODE_INFLIGHT = 32
COMMON = ["--preset", "tiny-full", "--device", "cpu", "--max-tokens", "8192", "--max-requests", "8"]


@pytest.fixture(scope="module")
def stack():
    with Launcher() as launcher:
        prefill = launcher.start("prefill", *COMMON, "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start("decode", *COMMON, "--max-inflight", str(DECODE_INFLIGHT),
                                "--bootstrap-addr", prefill["bootstrap"])
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        yield {"prefill": prefill["http"], "decode": decode["http"], "router": router["http"],
               "initial": (pool_free(prefill["http"]), pool_free(decode["http"]))}


def _connect(url: str) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=30)


def _read_answer(sock: socket.socket) -> tuple[int, dict]:
    """The final answer on `sock` (interim 1xx answers skipped): (status, JSON body)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    while data.startswith(b"HTTP/1.1 1"):
        data = data[data.index(b"\r\n\r\n") + 4:]
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _serves(stack) -> None:
    out = post_json(stack["router"] + "/generate", {"prompt_len": 77}, 60)
    assert out.get("ok") and out.get("verified"), out


def test_half_sent_bodies_do_not_take_the_in_flight_slots(stack):
    """Defect 4: 300 connections sending `POST /decode` headers and no body made decode answer
    every real request 503 until they closed: the slot was taken before the body was read."""
    head = b"POST /decode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    stalled = [_connect(stack["decode"]) for _ in range(DECODE_INFLIGHT + 8)]
    try:
        for sock in stalled:
            sock.sendall(head)
        t0 = time.monotonic()
        _serves(stack)      # before the fix: 503 "32 requests in flight"
        status, body = _read_answer(stalled[0])   # the stalled ones get a 408 once their time is up
        assert status == 408 and "not sent within" in body["error"], body
        assert READ_TIMEOUT_S - 1 < time.monotonic() - t0 < READ_TIMEOUT_S + 10
    finally:
        for sock in stalled:
            sock.close()


def test_a_body_cut_short_is_a_400_and_frees_nothing_it_did_not_take(stack):
    sock = _connect(stack["decode"])
    with sock:
        sock.sendall(b"POST /decode HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"room\": 1")
        sock.shutdown(socket.SHUT_WR)
        status, body = _read_answer(sock)
    assert status == 400 and "cut short" in body["error"], body
    assert inflight(stack["decode"]) == 0
    _serves(stack)


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_connections_past_the_bound_are_refused_at_once_and_the_rest_still_serve(stack, eventually):
    bound = max(64, 4 * DECODE_INFLIGHT)
    idle = [_connect(stack["decode"]) for _ in range(bound)]   # accepted in order: the next is one too many
    try:
        extra = _connect(stack["decode"])
        with extra:
            status, body = _read_answer(extra)
        assert status == 503 and "connections open" in body["error"], body
    finally:
        for sock in idle:
            sock.close()
    eventually(lambda: _health(stack["decode"]) == 200, 10, "the idle connections' threads ended")
    _serves(stack)


def test_a_client_that_half_closes_after_sending_gets_its_answer(stack):
    """Defect 7: shutting the sending side after the request was taken as a cancel (499)."""
    body = json.dumps({"prompt_len": 300, "seed": 7}).encode()
    sock = _connect(stack["router"])
    with sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
        sock.shutdown(socket.SHUT_WR)
        status, out = _read_answer(sock)
    assert status == 200 and out["ok"] and out["verified"], out


def test_nothing_leaked(stack, eventually):
    eventually(lambda: (pool_free(stack["prefill"]), pool_free(stack["decode"])) == stack["initial"]
               and inflight(stack["prefill"]) == 0 and inflight(stack["decode"]) == 0, 30,
               "both pools back to their initial free counts")
