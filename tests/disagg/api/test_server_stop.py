"""A stopped HTTP server closes every connection it still holds: kept alive between requests,
evicted or refused at its connection bound and lingering (answered, its input drained for
LINGER_S) when stop() came; none is left for the garbage collector to find open (an unclosed
server socket's ResourceWarning surfaced once in a full run, not reproduced: the stop now closes
what its loop would have closed later). And a request on a connection this layer already
answered and ended writes nothing there (it used to log aiohttp's "Unhandled exception":
RuntimeError, write() after write_eof())."""

import asyncio
import socket
import threading

from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry

from disagg.api.connections import LINGER_S, HttpLimits
from disagg.api.server import ApiServer, Service

WAIT_S = 4 * LINGER_S  # what a stopped server leaves open is never closed: recv times out


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    s.settimeout(WAIT_S)
    return s


def _read_to_end(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (raises TimeoutError if it never does)."""
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _post(path: str) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode()


def test_a_stopped_server_closes_its_lingering_connections():
    release, running = threading.Event(), threading.Semaphore(0)

    def slow(body):
        running.release()
        return {"released": release.wait(WAIT_S)}

    routes = {"/echo": lambda body: body, "/slow": slow}
    server = ApiServer(("127.0.0.1", 0), Service(routes, lambda: True, CollectorRegistry()), HttpLimits(2, 0)).start()
    socks = []
    try:
        socks.append(_connect(server.port))  # asks once, then stays open (keep-alive), idle
        socks[0].sendall(_post("/echo"))
        assert socks[0].recv(65536).startswith(b"HTTP/1.1 200"), "the request was not answered"
        for _ in range(2):  # the second evicts the idle one (the bound is two)
            socks.append(_connect(server.port))
            socks[-1].sendall(_post("/slow"))
            assert running.acquire(timeout=WAIT_S), "the slow route did not start"
        assert socks[0].recv(65536).startswith(b"HTTP/1.1 408 Request Timeout")  # evicted, lingering
        socks.append(_connect(server.port))  # every open one serves a request: refused, lingering
        assert socks[3].recv(65536).startswith(b"HTTP/1.1 503 Service Unavailable")
        release.set()
        assert all(s.recv(65536).startswith(b"HTTP/1.1 200") for s in socks[1:3])
        server.stop()
        assert [_read_to_end(s) for s in socks] == [b""] * 4  # each one closed by the stop
    finally:
        release.set()
        server.stop()
        for s in socks:
            s.close()


def test_a_request_on_a_connection_already_ended_writes_nothing():
    server = ApiServer(("127.0.0.1", 0), Service({"/echo": lambda body: body}, lambda: True, CollectorRegistry()))
    server.start()
    try:
        request = make_mocked_request("POST", "/echo")  # its transport is none this server holds
        answer = asyncio.run_coroutine_threadsafe(server._handle(request), server._loop).result(WAIT_S)
        try:
            asyncio.run_coroutine_threadsafe(answer.prepare(request), server._loop).result(WAIT_S)
        except ConnectionResetError as exc:
            assert "already answered and ended" in str(exc)
        else:
            raise AssertionError("an answer was prepared for a connection already ended")
    finally:
        server.stop()
