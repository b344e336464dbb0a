"""A listening socket of this process, found by its port (Linux: /proc/self/net and
/proc/self/fd), and how to make the thread blocked in its accept() return at once.

Why (transports/mooncake.py): destroying a Mooncake engine joins its handshake listener, a
thread that waits in accept() with a 1 s SO_RCVTIMEO and checks its stop flag between waits,
and the destructor holds the GIL meanwhile: 0.93 s per engine during which no Python thread
of the process runs (a bootstrap serving in the same process missed its 5 s answer while
one test's twelve engines went). A receive timeout changes the next accept(), not the one
waiting; so `hurry` sets 1 ms (the kernel rounds it up to a clock tick) and then connects
once and closes, which ends the wait under way (the listener reads EOF and drops the
connection): destroying four engines then took 35 ms, not 4.0 s.
"""

import os
import socket
import struct

_LISTEN = "0A"  # TCP state LISTEN in /proc/net/tcp


def listening_fd(port: int) -> tuple[int, int] | None:
    """(fd, address family) of this process's socket listening on `port`, or None."""
    inodes: dict[str, int] = {}
    for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/self/net/{name}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _LISTEN and int(cols[1].rpartition(":")[2], 16) == port:
                inodes[cols[9]] = family
    for fd in os.listdir("/proc/self/fd") if inodes else ():
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in inodes:
            return int(fd), inodes[link[8:-1]]
    return None


def hurry_listener(port: int) -> None:
    """`hurry` this process's socket listening on `port`, if there is one."""
    found = listening_fd(port)
    if found is not None:
        hurry(*found, port)


def hurry(fd: int, family: int, port: int) -> None:
    """Make the accept() waiting on listening socket `fd` (port `port`) and every later one
    return within a clock tick; best effort (a socket gone or refusing is left as it is)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 1000))
    except OSError:
        return
    finally:
        s.detach()  # (the fd stays its owner's)
    loopback = "::1" if family == socket.AF_INET6 else "127.0.0.1"
    try:
        socket.create_connection((loopback, port), timeout=1.0).close()
    except OSError:
        pass
