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

import socket
import struct

from transfer.transports.proc_tcp import LISTEN, own_inodes, sockets


def listening_fd(port: int) -> tuple[int, int] | None:
    """(fd, address family) of this process's socket listening on `port`, or None."""
    listening = {s.inode: s.family for s in sockets() if s.state == LISTEN and s.local[1] == port}
    fds = own_inodes() if listening else {}
    return next(((fd, listening[inode]) for inode, fd in fds.items() if inode in listening), None)


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
