"""Outbox: any thread hands frames to the one I/O thread that owns the network sockets.

ZMQ sockets are not thread-safe. Producers share one inproc PUSH socket under a lock (the
lock serializes access and gives ZMQ the memory barrier it needs between threads); the I/O
thread polls the PULL end next to its network sockets, so a frame goes out without polling
delay. One socket, not one per thread: HTTP handler threads live for one request each, and
a socket per thread leaked a file descriptor per request (found by scripts/soak.sh).
"""

import itertools
import threading

import zmq

_ids = itertools.count()


class Outbox:
    def __init__(self, context: zmq.Context):
        self.address = f"inproc://outbox-{next(_ids)}"
        self.pull = context.socket(zmq.PULL)  # owned by the I/O thread
        self.pull.bind(self.address)
        self._push = context.socket(zmq.PUSH)
        self._push.connect(self.address)
        self._lock = threading.Lock()

    def put(self, *frames: bytes) -> None:
        with self._lock:
            self._push.send_multipart(frames)

    def close(self) -> None:
        with self._lock:
            self._push.close(linger=0)
        self.pull.close(linger=0)
