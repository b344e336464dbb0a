"""The control sockets of each role: they receive frames, decode them, and send frames. They
know nothing of requests; the role's loop pulls messages from them and decides.

    prefill  RouterIO   one ROUTER; a decode peer is a DEALER identity
    decode   DealerIO   one DEALER per prefill control endpoint, connected on first use

ZMQ sockets are not thread-safe: only the loop thread calls recv() and reply(); any thread
may send() (through the outbox, which the loop drains next to the network sockets) and wake()
(an empty outbox frame: the loop's recv returns at once, to take what another thread queued
for it elsewhere, e.g. a vLLM step's loads in a Handoff).
"""

import logging
from collections.abc import Iterator

import zmq

from disagg.control.auth import Gate
from disagg.control.messages import Decoder, ToDecode, ToPrefill, encoder
from disagg.control.outbox import Outbox
from disagg.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)


class RouterIO:
    def __init__(self, gate: Gate, host: str, port: int = 0):
        ctx = gate.ctx
        self._router = gate.server(ctx.socket(zmq.ROUTER), "prefill control socket")
        try:
            if port:
                self._router.bind(f"tcp://{host}:{port}")
            else:
                port = self._router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as exc:
            self._router.close(linger=0)
            raise ConfigError(
                f"control socket tcp://{host}:{port or '*'}: cannot bind ({exc}); check --host and --control-port"
            ) from None
        self.endpoint = f"tcp://{host}:{port}"
        self._outbox = Outbox(ctx)
        self._decoder = Decoder(ToPrefill, "prefill control")
        self._poller = zmq.Poller()
        self._poller.register(self._router, zmq.POLLIN)
        self._poller.register(self._outbox.pull, zmq.POLLIN)

    def send(self, identity: bytes, msg) -> None:
        """From any thread."""
        self._outbox.put(identity, encoder.encode(msg))

    def reply(self, identity: bytes, msg) -> None:
        """From the loop thread."""
        self._router.send_multipart([identity, encoder.encode(msg)])

    def wake(self) -> None:
        """From any thread: a recv() waiting now (or next) returns at once."""
        self._outbox.put(b"")

    def recv(self, timeout_ms: int) -> Iterator[tuple[bytes, object]]:
        """(identity, message) for each frame that arrived within timeout_ms; a frame that does
        not decode comes as a ProtocolError. Frames queued by send() go out on the way."""
        events = dict(self._poller.poll(timeout_ms))
        while self._outbox.pull.poll(0):
            frames = self._outbox.pull.recv_multipart()
            if len(frames) == 2:  # (one frame: a wake)
                self._router.send_multipart(frames)
        while self._router in events and self._router.poll(0):
            frames = self._router.recv_multipart()
            if len(frames) != 2:
                continue  # not a DEALER frame of ours
            try:
                yield frames[0], self._decoder.decode(frames[1])
            except ProtocolError as exc:
                yield frames[0], exc

    def close(self) -> None:
        self._outbox.close()
        self._router.close(linger=0)


class DealerIO:
    def __init__(self, gate: Gate):
        self._gate, ctx = gate, gate.ctx
        self._ctx = ctx
        self._dealers: dict[str, zmq.Socket] = {}
        self._outbox = Outbox(ctx)
        self._decoder = Decoder(ToDecode, "decode control")
        self._poller = zmq.Poller()
        self._poller.register(self._outbox.pull, zmq.POLLIN)

    def send(self, endpoint: str, msg, connect: bool = False) -> None:
        """From any thread; `connect` opens a socket to the endpoint first if there is none
        (a registration), else a message to an endpoint without a socket is dropped."""
        self._outbox.put(b"connect" if connect else b"send", endpoint.encode(), encoder.encode(msg))

    def reply(self, endpoint: str, msg) -> None:
        """From the loop thread."""
        sock = self._dealers.get(endpoint)
        if sock is not None:
            sock.send(encoder.encode(msg))

    def wake(self) -> None:
        """From any thread: a recv() waiting now (or next) returns at once."""
        self._outbox.put(b"")

    def drop(self, endpoint: str) -> None:
        """From the loop thread: close the socket of a lost peer (a new registration connects
        afresh)."""
        sock = self._dealers.pop(endpoint, None)
        if sock is not None:
            self._poller.unregister(sock)
            sock.close(linger=0)

    def recv(self, timeout_ms: int) -> Iterator[tuple[str, object]]:
        events = dict(self._poller.poll(timeout_ms))
        while self._outbox.pull.poll(0):
            frames = self._outbox.pull.recv_multipart()
            if len(frames) != 3:  # a wake
                continue
            kind, endpoint, payload = frames
            endpoint = endpoint.decode()
            if kind == b"connect" and endpoint not in self._dealers:
                sock = self._gate.client(self._ctx.socket(zmq.DEALER), f"control link to prefill {endpoint}")
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                self._dealers[endpoint] = sock
                self._poller.register(sock, zmq.POLLIN)
            sock = self._dealers.get(endpoint)
            if sock is not None:
                sock.send(payload)
        for endpoint, sock in list(self._dealers.items()):
            while self._dealers.get(endpoint) is sock and sock in events and sock.poll(0):
                try:
                    yield endpoint, self._decoder.decode(sock.recv())
                except ProtocolError as exc:
                    yield endpoint, exc

    def close(self) -> None:
        for sock in self._dealers.values():
            sock.close(linger=0)
        self._dealers.clear()
        self._outbox.close()
