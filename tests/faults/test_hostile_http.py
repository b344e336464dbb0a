"""HTTP that cannot be starved (issue 17, defects 4 and 7): connections that send half a
request, too many connections, and a client that half-closes after sending, against real
router/prefill/decode processes."""

import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from disagg.api.connections import HttpLimits
from disagg.router.router import post_json
from disagg.tools.launcher import Launcher
from fault_stack import inflight, pool_free

pytestmark = pytest.mark.slow
DECODE_INFLIGHT = 32
READ_TIMEOUT_S = HttpLimits().receive_s
COMMON = ["--preset", "tiny-full", "--device", "cpu", "--max-tokens", "8192", "--max-requests", "8"]


@pytest.fixture(scope="module")
def stack():
    with Launcher() as launcher:
        prefill = launcher.start("prefill", *COMMON, "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start(
            "decode", *COMMON, "--max-inflight", str(DECODE_INFLIGHT), "--bootstrap-addr", prefill["bootstrap"]
        )
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        yield {
            "prefill": prefill["http"],
            "decode": decode["http"],
            "router": router["http"],
            "bootstrap": prefill["bootstrap"],
            "initial": (pool_free(prefill["http"]), pool_free(decode["http"])),
        }


def _connect(url: str) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=30)


def _read_answer(sock: socket.socket) -> tuple[int, dict]:
    """The final answer on `sock` (interim 1xx answers skipped): (status, JSON body)."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    while data.startswith(b"HTTP/1.1 1"):
        data = data[data.index(b"\r\n\r\n") + 4 :]
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
        _serves(stack)  # before the fix: 503 "32 requests in flight"
        status, body = _read_answer(stalled[0])  # the stalled ones get a 408 once their time is up
        assert status == 408 and "not sent within" in body["error"], body
        assert READ_TIMEOUT_S - 1 < time.monotonic() - t0 < READ_TIMEOUT_S + 10
    finally:
        for sock in stalled:
            sock.close()


def test_a_body_cut_short_is_a_400_and_frees_nothing_it_did_not_take(stack):
    sock = _connect(stack["decode"])
    with sock:
        sock.sendall(b'POST /decode HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"room": 1')
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


def test_idle_connections_at_the_bound_make_room_for_probes_and_requests(stack, eventually):
    """Connections that send nothing fill the bound (max-inflight + headroom): the next one
    still gets in, /health answers, and the connection idle longest is closed for it."""
    bound = HttpLimits(max_inflight=DECODE_INFLIGHT).max_connections
    idle = [_connect(stack["decode"]) for _ in range(bound)]
    try:
        assert _health(stack["decode"]) == 200  # before issue 35: 503 "64 connections open"
        status, body = _read_answer(idle[0])  # the oldest idle one made room
        assert status == 408 and "make room" in body["error"], body
        _serves(stack)
    finally:
        for sock in idle:
            sock.close()


@pytest.fixture(scope="module")
def small_router(stack):
    """A router with a connection bound of 4 + 32 and a 2 s receipt deadline."""
    with Launcher() as launcher:
        yield launcher.start(
            "router",
            "--pair",
            f"{stack['prefill']},{stack['decode']},{stack['bootstrap']}",
            "--max-inflight",
            "4",
            "--http-receive-timeout",
            "2",
        )["http"]


def _get_health(sock: socket.socket) -> int:
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    )
    while length:
        length -= len(sock.recv(length))
    return int(head.split()[1])


def test_the_router_holds_as_many_connections_as_its_in_flight_bound(stack):
    """Issue 35, defect 1: the router's bound was max(64, 4 * 0) whatever --max-inflight said:
    100 concurrent clients got 503 "64 connections open". Now it follows --max-inflight (256)."""
    socks = [_connect(stack["router"]) for _ in range(100)]
    try:
        assert [_get_health(sock) for sock in socks] == [200] * 100  # all open at once (keep-alive)
    finally:
        for sock in socks:
            sock.close()


def _trickle(sock: socket.socket, stop: threading.Event) -> None:
    """Slowloris: a request line, then one header byte at a time, never the end of the headers."""
    try:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        while not stop.wait(0.25):
            sock.sendall(b"a")
    except OSError:
        pass  # closed by the server: what the test waits for


def test_trickled_headers_are_cut_off_at_one_total_deadline(small_router):
    """Issue 35, defect 2: the timeout was per read, so a byte every 5 s held a connection for
    as long as the client liked. Now headers and body have one deadline (2 s here)."""
    sock, stop = _connect(small_router), threading.Event()
    sender = threading.Thread(target=_trickle, args=(sock, stop))
    t0 = time.monotonic()
    sender.start()
    try:
        status, body = _read_answer(sock)
    finally:
        stop.set()
        sender.join()
        sock.close()
    assert status == 408 and "not sent within 2 s" in body["error"], body
    assert time.monotonic() - t0 < 2 + 3


def test_slow_clients_at_the_bound_cannot_keep_real_requests_out(small_router):
    """Issue 35, defect 2: 64 trickling connections kept the router down. Now a newcomer
    evicts the one that has been receiving longest, and real requests are served."""
    bound = HttpLimits(max_inflight=4).max_connections
    socks = [_connect(small_router) for _ in range(bound)]
    stop = threading.Event()
    senders = [threading.Thread(target=_trickle, args=(sock, stop)) for sock in socks]
    for t in senders:
        t.start()
    try:
        for n in (50, 60, 70):
            out = post_json(small_router + "/generate", {"prompt_len": n}, 30)
            assert out.get("ok") and out.get("verified"), out
    finally:
        stop.set()
        for sock in socks:
            sock.close()
        for t in senders:
            t.join()


def _dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size, _, data = data.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, data = out + data[:n], data[n + 2 :]


def test_a_half_closed_event_stream_carries_nothing_but_events(stack):
    """Issue 35, defect 3: after a client half-closed, `100 Continue` (the probe for a client
    gone) was written into the event stream once the first event had gone out."""
    body = json.dumps({"prompt": list(range(1, 200)), "max_tokens": 256, "stream": True}).encode()
    sock = _connect(stack["router"])
    with sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    while data.startswith(b"HTTP/1.1 1"):  # interim answers before the stream began are allowed
        data = data[data.index(b"\r\n\r\n") + 4 :]
    head, _, stream = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"HTTP/1.1" not in stream, stream[:500]
    if b"transfer-encoding: chunked" in head.lower():
        stream = _dechunk(stream)
    events = [e for e in stream.split(b"\n\n") if e.strip()]
    assert events[-1] == b"data: [DONE]" and all(e.startswith(b"data: ") for e in events), events[-3:]
    tokens = [t for e in events[:-1] for t in json.loads(e[6:])["choices"][0]["token_ids"]] if events else []
    assert len(tokens) == 256


def test_a_client_that_half_closes_after_sending_gets_its_answer(stack):
    """Defect 7: shutting the sending side after the request was taken as a cancel (499)."""
    body = json.dumps({"prompt_len": 300, "seed": 7}).encode()
    sock = _connect(stack["router"])
    with sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body)
        )
        sock.shutdown(socket.SHUT_WR)
        status, out = _read_answer(sock)
    assert status == 200 and out["ok"] and out["verified"], out


def test_nothing_leaked(stack, eventually):
    eventually(
        lambda: (
            (pool_free(stack["prefill"]), pool_free(stack["decode"])) == stack["initial"]
            and inflight(stack["prefill"]) == 0
            and inflight(stack["decode"]) == 0
        ),
        30,
        "both pools back to their initial free counts",
    )
