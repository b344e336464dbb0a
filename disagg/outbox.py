"""Outbox: any thread hands frames to the one I/O thread that owns the ZMQ sockets.

ZMQ sockets are not thread-safe, so worker threads never touch them: each thread gets its
own inproc PUSH socket (thread-local) into the I/O thread's PULL, which the I/O loop polls next
to its network sockets, so a frame from a worker goes out without polling delay.
"""

import itertools
import threading

import zmq

_ids = itertools.count()


class Outbox:
    def __init__(self, context: zmq.Context):
        self._ctx = context
        self.address = f"inproc://outbox-{next(_ids)}"
        self.pull = context.socket(zmq.PULL)   # owned by the I/O thread
        self.pull.bind(self.address)
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()

    def put(self, *frames: bytes) -> None:
        sock = getattr(self._local, "sock", None)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.connect(self.address)
            self._local.sock = sock
            with self._lock:
                self._sockets.append(sock)
        sock.send_multipart(frames)

    def close(self) -> None:
        with self._lock:
            for s in self._sockets:
                s.close(linger=0)
        self.pull.close(linger=0)
