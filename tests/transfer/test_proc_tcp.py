"""The kernel's TCP tables read back, on real loopback sockets: what a connection closed with
bytes still on their way looks like on each side (transfer/transports/proc_tcp.py)."""

import ipaddress
import socket

from transfer.transports import proc_tcp

LOOPBACK = ipaddress.ip_address("127.0.0.1")
ELSEWHERE = ipaddress.ip_address("192.0.2.1")  # TEST-NET-1: no socket here goes there


def _pair(rcvbuf: int = 0) -> tuple[socket.socket, socket.socket, socket.socket]:
    """(listener, client, accepted server end) on loopback; `rcvbuf`: the listener's receive
    buffer (inherited by the accepted socket), 0 for the default."""
    listener = socket.socket()
    if rcvbuf:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    client = socket.create_connection(listener.getsockname())
    server, _ = listener.accept()
    return listener, client, server


def _row(local_port: int, remote_port: int) -> proc_tcp.Socket | None:
    return next((s for s in proc_tcp.sockets() if s.local[1] == local_port and s.remote[1] == remote_port), None)


def test_a_connection_reads_back_with_its_addresses_state_queues_and_owner():
    listener, client, server = _pair()
    try:
        client.sendall(b"x" * 1000)
        port, client_port = listener.getsockname()[1], client.getsockname()[1]
        assert port in proc_tcp.listening_ports() and client_port not in proc_tcp.listening_ports()
        row = _row(port, client_port)
        assert row.local == (LOOPBACK, port) and row.remote == (LOOPBACK, client_port)
        assert row.state == proc_tcp.ESTABLISHED and row.rx_queue == 1000 and row.family == socket.AF_INET
        assert proc_tcp.own_inodes()[row.inode] == server.fileno()
        server.recv(1000)
        assert _row(port, client_port).rx_queue == 0
    finally:
        for s in (client, server, listener):
            s.close()


def test_bytes_left_unread_after_the_sender_closed_count_on_that_port_until_read(eventually):
    listener, client, server = _pair()
    try:
        port = listener.getsockname()[1]
        client.sendall(b"y" * 5000)
        client.close()
        eventually(lambda: proc_tcp.unread_after_close({port}) == 1, 10, "the server end in CLOSE_WAIT, unread")
        assert proc_tcp.unread_after_close({port + 1}) == 0  # another port's sockets only
        got = b""
        while len(got) < 5000:
            got += server.recv(65536)
        assert proc_tcp.unread_after_close({port}) == 0
    finally:
        server.close()
        listener.close()


def test_a_closed_socket_with_bytes_the_peer_has_not_taken_is_an_orphan_toward_its_host(eventually):
    """The receiver does not read: the client's bytes fill both buffers; closed, the client's
    socket lives on as an orphan (FIN-WAIT-1, bytes unacknowledged) until the receiver reads
    them all, and only toward the receiver's host."""
    before = proc_tcp.orphans_toward({LOOPBACK})
    listener, client, server = _pair(rcvbuf=4096)
    try:
        client.setblocking(False)
        sent = 0
        try:
            while True:
                sent += client.send(b"z" * 65536)
        except BlockingIOError:
            pass
        client.close()
        assert proc_tcp.orphans_toward({LOOPBACK}) == before + 1
        assert proc_tcp.orphans_toward({ELSEWHERE}) == 0
        assert proc_tcp.orphans_toward(None) >= before + 1
        got = 0
        while got < sent:
            got += len(server.recv(1 << 20))
        eventually(lambda: proc_tcp.orphans_toward({LOOPBACK}) <= before, 10, "the orphan delivered everything")
    finally:
        server.close()
        listener.close()
