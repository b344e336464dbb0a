"""TCP sockets as the kernel lists them (Linux: /proc/self/net/tcp and tcp6, the calling
process's network namespace), and which of them may still move bytes nobody waits for.

Why (transports/mooncake.py, "Late bytes"): a Mooncake TCP write that fails, or that was
abandoned and then fails, ends with its connection closed; close() does not discard what
the socket had not delivered yet. The kernel keeps the socket as an orphan (no process owns
it, inode 0) and keeps retransmitting its data and then its FIN (with the default
tcp_orphan_retries, for over 100 s), and the peer's Mooncake reads that data into the
address named by the header it already received. So until the orphan's FIN is acknowledged
(the peer's kernel holds every byte) and the peer's Mooncake has read them (its socket, in
CLOSE_WAIT, holds nothing unread), such bytes may still land in pages that are free again.
Measured (two network namespaces, 256 MiB written, the link cut 30 ms in, the write failed at
3 s, the destination zeroed, the link up 7 s later): four FIN-WAIT-1 orphans with 2.3-3.5 MB
each, and 11 MB landed in the zeroed destination after the link came back.

Reading the tables costs about a millisecond per thousand sockets: asked on failure paths
only, never per write.
"""

import ipaddress
import os
import socket
from collections.abc import Collection, Iterable, Iterator
from dataclasses import dataclass

Address = ipaddress.IPv4Address | ipaddress.IPv6Address

# TCP states (include/net/tcp_states.h), as /proc/net/tcp writes them (hex)
ESTABLISHED, FIN_WAIT1, CLOSE_WAIT, LAST_ACK, LISTEN, CLOSING = 0x01, 0x04, 0x08, 0x09, 0x0A, 0x0B
_FIN_UNACKED = (FIN_WAIT1, CLOSING, LAST_ACK)  # we closed; the peer has not acknowledged all we sent


@dataclass(frozen=True)
class Socket:
    local: tuple[Address, int]  # (address, port); IPv4-mapped IPv6 addresses as IPv4
    remote: tuple[Address, int]
    state: int
    tx_queue: int  # bytes sent and not acknowledged by the peer, or not sent yet
    rx_queue: int  # bytes received and not read by the socket's owner
    inode: int  # 0: an orphan (closed by its process, still alive in the kernel)
    family: int  # socket.AF_INET (the tcp table) or AF_INET6 (tcp6)


def sockets() -> Iterator[Socket]:
    """Every TCP socket of this network namespace, IPv4 then IPv6 (none where the tables
    cannot be read: not Linux)."""
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/self/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            tx, _, rx = cols[4].partition(":")
            local, remote, state = _endpoint(cols[1]), _endpoint(cols[2]), int(cols[3], 16)
            yield Socket(local, remote, state, int(tx, 16), int(rx, 16), int(cols[9]), family)


def _endpoint(text: str) -> tuple[Address, int]:
    """'0100007F:1F90' (the address as the kernel stores it: 32-bit words in host order, here
    little-endian) -> (127.0.0.1, 8080)."""
    hexaddr, _, port = text.partition(":")
    raw = b"".join(int(hexaddr[i : i + 8], 16).to_bytes(4, "little") for i in range(0, len(hexaddr), 8))
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address, int(port, 16)


def own_inodes() -> dict[int, int]:
    """The socket inodes of this process's open file descriptors: inode -> fd."""
    found = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(fd)
    return found


def listening_ports() -> set[int]:
    """The ports this process listens on."""
    mine = own_inodes()
    return {s.local[1] for s in sockets() if s.state == LISTEN and s.inode in mine}


def orphans_toward(hosts: Collection[Address] | None, table: Iterable[Socket] | None = None) -> int:
    """Orphaned sockets toward any of `hosts` (None: any host) that still hold bytes or a FIN
    the peer has not acknowledged: what they carry may still land there. `table`: sockets()
    read once for several questions (None: read now)."""
    return sum(
        1
        for s in (sockets() if table is None else table)
        if s.inode == 0 and (s.tx_queue > 0 or s.state in _FIN_UNACKED) and (hosts is None or s.remote[0] in hosts)
    )


def unread_after_close(ports: Collection[int], table: Iterable[Socket] | None = None) -> int:
    """Sockets on any of these local `ports` whose peer closed its side (CLOSE_WAIT) while
    bytes it sent are still unread here: their reader has yet to put them where they go.
    `table` as for orphans_toward."""
    return sum(
        1
        for s in (sockets() if table is None else table)
        if s.state == CLOSE_WAIT and s.rx_queue > 0 and s.local[1] in ports
    )
