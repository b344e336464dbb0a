"""post_json never raises: a peer that dies mid-answer is a FAILED result with a reason (the
soak once got a 500 from the router when a killed worker cut its answer short)."""

import socket
import threading

import pytest

from disagg.router.router import post_json


@pytest.mark.parametrize(
    "answer",
    [
        b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\nContent-Type: application/json\r\n\r\n{"a":',  # cut short
        b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\n{x}",  # not JSON
        b"garbage\r\n\r\n",  # not HTTP
        b"",  # closed
    ],
)
def test_a_broken_answer_is_a_failed_result(answer):
    with socket.create_server(("127.0.0.1", 0)) as server:

        def serve():
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(answer)
                conn.shutdown(socket.SHUT_WR)
                conn.recv(1)  # until the client closes

        t = threading.Thread(target=serve)
        t.start()
        out = post_json(f"http://127.0.0.1:{server.getsockname()[1]}/prefill", {"room": 1}, 10)
        t.join(10)
    assert out["state"] == "FAILED" and out["reason"].startswith("http://127.0.0.1:")
