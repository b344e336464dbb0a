"""transfer/transports/listeners.py: a listening socket of this process found by its port,
and an accept() under way made to return (real sockets; real Mooncake engines)."""

import socket
import struct
import threading

from transfer.transports.listeners import hurry, listening_fd
from transfer.transports.mooncake import MooncakeTransport


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("0.0.0.0", 0))
    s.listen()
    return s


def _receive_timeout_us(fd: int) -> int:
    s = socket.socket(fileno=fd)
    try:
        sec, usec = struct.unpack("ll", s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
    finally:
        s.detach()
    return sec * 1_000_000 + usec


def test_a_listening_socket_is_found_by_its_port_and_nothing_else():
    with _listener() as s, socket.socket() as bound:
        bound.bind(("0.0.0.0", 0))  # bound, not listening
        assert listening_fd(s.getsockname()[1]) == (s.fileno(), socket.AF_INET)
        assert listening_fd(bound.getsockname()[1]) is None


def test_hurry_ends_the_accept_under_way_and_every_later_one_returns():
    """A thread blocked in accept() (no timeout) gets hurry's connection; its next accept()
    gives up within the receive timeout hurry set instead of waiting for ever."""
    with _listener() as s:
        s.setblocking(True)
        seen: list = []

        def serve():
            conn, _ = s.accept()
            seen.append(conn.recv(1))  # b"": hurry's connection, closed at once
            conn.close()
            try:
                s.accept()
            except OSError as exc:  # (EAGAIN: the receive timeout)
                seen.append(type(exc))

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        hurry(*listening_fd(s.getsockname()[1]), s.getsockname()[1])
        thread.join(10)
        assert not thread.is_alive(), "an accept() is still waiting"
        assert seen[0] == b"" and issubclass(seen[1], OSError), seen
        assert 0 < _receive_timeout_us(s.fileno()) <= 10_000  # (1 ms asked: the kernel rounds to its tick)


def test_closing_a_mooncake_transport_hurries_every_engine_listener():
    """Destroying an engine joins its handshake listener with the GIL held: close() sets each
    one's accept() to return within a clock tick first."""
    t = MooncakeTransport(engines=2)
    fds = [listening_fd(te.get_rpc_port())[0] for te in t.engines]
    assert all(_receive_timeout_us(fd) == 1_000_000 for fd in fds)  # Mooncake's own: 1 s
    t.close()
    assert all(0 < _receive_timeout_us(fd) <= 10_000 for fd in fds)
    t.close()  # (again: nothing left to do)
