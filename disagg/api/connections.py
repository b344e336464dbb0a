"""The HTTP server's connection limits: what aiohttp (like uvicorn and hypercorn) does not
bound on its own. Its keep-alive timeout is reset by every byte, so a client trickling one
header byte every few seconds holds a connection forever (uvicorn issue #157 is the same gap),
and it bounds nothing about how many connections are open.

Each accepted connection is wrapped in a `Connection` that forwards every event to aiohttp's
own protocol object and adds three rules:

    receipt deadline   a request's headers and body arrive within `receive_s` of its first
                       byte, in total (not per read); past it: 408 and the connection closes
    connection bound   at most `max_connections` open; a new one evicts the connection that
                       has waited longest without a request being served (idle, or still
                       receiving); only when every open connection is running a request is
                       the newcomer answered 503 (so probes and /metrics get in while slow
                       or idle clients hold the rest)
    half-close         a client that shuts its sending side after a whole request still gets
                       its answer (then the connection closes); one that does so in the middle
                       of its request gets 400 "cut short"

A connection is in one of three states:

    IDLE ----first byte----> RECEIVING ----request whole----> BUSY ----answered----> IDLE
      evictable                  | deadline: 408, close               (never evicted,
                                 | half-closed mid-request: 400        no deadline)
                                 | evictable

`gone()` tells a route whether its client went away (a cancel). A client that half-closed
looks like one that closed until something is written to it, so before the answer has
started an HTTP/1.1 client is sent an interim `100 Continue` (which every HTTP/1.1 client
skips) at most every PROBE_EVERY_S: a closed socket answers it with a reset, which the loop
reports as the connection being lost. Never once the answer has started (an event stream).
"""

import asyncio
import enum
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

PROBE_EVERY_S = 0.5
HEAD_TURNS = 4  # loop turns after a half-close before headers still not whole are refused
LINGER_S = 2.0
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


@dataclass(frozen=True)
class HttpLimits:
    """The DoS limits of one HTTP server (every process has one)."""

    max_inflight: int = 0  # POSTs running at once (0: no limit); more: 503 at once
    headroom: int = 32  # connections beyond max_inflight: probes, /metrics, keep-alive
    receive_s: float = 10.0  # a request's headers and body, in total, from its first byte
    idle_s: float = 10.0  # a keep-alive connection with no request is closed after this
    max_body_bytes: int = 16 << 20

    @property
    def max_connections(self) -> int:
        return (self.max_inflight or 32) + self.headroom


class State(enum.Enum):
    IDLE = "idle"  # connected, no request under way
    RECEIVING = "receiving"  # a request's bytes are arriving
    BUSY = "busy"  # a route runs (or answers) this connection's request


def raw_answer(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer, for the few the connection layer gives before aiohttp has a
    request to answer (the connection closes after it)."""
    body = json.dumps({"error": message}).encode()
    return (
        b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n%sContent-Length: %d\r\n\r\n%s"
        % (status, reason.encode(), b"Retry-After: 1\r\n" if status == 503 else b"", len(body), body)
    )


class Connection(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, the rules of the module around it.
    Runs on the server's event loop; `gone()` and `started()` may be called from a route's
    thread."""

    def __init__(self, inner: asyncio.Protocol, owner: "Connections"):
        self.inner, self.owner = inner, owner
        self.transport: asyncio.Transport | None = None
        self.state, self.since = State.IDLE, time.monotonic()
        self.http11, self.answer_started, self.eof, self.lost = True, False, False, False
        self.routed = False  # the current request reached a route (its headers are whole)
        self.admitted = False  # under the bound: aiohttp's protocol saw the connection
        self.refused = False  # answered by this layer (408/400/503): closing, input dropped
        self.eof_event = asyncio.Event()
        self._deadline: asyncio.TimerHandle | None = None
        self._probed = float("-inf")

    # --- the events, forwarded
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.admitted = self.owner.admit(self)
        if self.admitted:
            self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self.admitted or self.refused:
            return
        if self.state is State.IDLE and data:
            self._enter(State.RECEIVING)
            self._deadline = asyncio.get_running_loop().call_later(self.owner.limits.receive_s, self._too_slow)
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        """Keep the connection open for the answer (a half-close is not a cancel) unless
        the client stopped in the middle of its request's headers."""
        self.eof = True
        self.eof_event.set()
        if self.refused:
            return True  # the lingering close ends it
        if not self.admitted or self.state is State.IDLE:
            return None  # nothing asked: close
        if self.state is State.RECEIVING and not self.routed:
            self._after_turns(HEAD_TURNS, self._cut_short)
        return True

    def _after_turns(self, turns: int, then: Callable[[], None]) -> None:
        """Run `then` once the loop has run everything queued now, `turns` times over. Bytes
        always arrive a turn before the end of the stream that follows them, and aiohttp
        reaches the route within HEAD_TURNS - 1 turns of a request's last header byte (its
        reader wakes, then starts the request's task): so by then a request whose headers
        arrived whole has been routed."""
        loop = asyncio.get_running_loop()
        loop.call_soon(then if turns <= 1 else lambda: self._after_turns(turns - 1, then))

    def _cut_short(self) -> None:
        if self.state is State.RECEIVING and not self.routed:
            self._refuse(
                400, "Bad Request", "BadRequest: request cut short: the connection ended before its headers did"
            )

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.eof_event.set()
        self._disarm()
        self.owner.forget(self)
        if self.admitted:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.admitted:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.admitted:
            self.inner.resume_writing()

    # --- the request's life (called by the server on the loop)
    def routing(self, http11: bool) -> None:
        """The request's headers are whole and a route was found: its body is read next."""
        self.routed, self.http11 = True, http11

    def received(self) -> None:
        """The request arrived whole: its route runs now, with no deadline."""
        self._disarm()
        self._enter(State.BUSY)

    def answered(self) -> None:
        self.routed, self.answer_started = False, False
        self._enter(State.IDLE)

    # --- from a route's thread
    def started(self) -> None:
        self.answer_started = True

    def gone(self) -> bool:
        if self.lost:
            return True
        if not self.eof or self.answer_started:
            return False
        if not self.http11:
            return True  # HTTP/1.0 has no interim answers: end-of-stream is a cancel
        now = time.monotonic()
        if now - self._probed >= PROBE_EVERY_S:
            self._probed = now
            self.owner.loop.call_soon_threadsafe(self._probe)
        return False

    # --- inside
    def _probe(self) -> None:
        if not self.lost and not self.answer_started and self.transport is not None:
            self.transport.write(_CONTINUE)

    def _enter(self, state: State) -> None:
        self.state, self.since = state, time.monotonic()

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _too_slow(self) -> None:
        self._deadline = None
        if self.state is State.RECEIVING:
            log.debug("closing a connection whose request was not sent within %g s", self.owner.limits.receive_s)
            self._refuse(408, "Request Timeout", f"request not sent within {self.owner.limits.receive_s:g} s")

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer and close, lingering: the answer goes out, then end-of-stream, and what the
        client still sends is read and dropped for LINGER_S before the socket closes (closing
        with unread bytes would send a reset that can overtake the answer)."""
        if self.refused or self.transport is None or self.transport.is_closing():
            return
        self.refused = True
        self.transport.write(raw_answer(status, reason, message))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        asyncio.get_running_loop().call_later(LINGER_S, self.transport.close)

    def evict(self) -> None:
        """Make room for a newcomer: close this connection (idle or still receiving)."""
        self._refuse(
            408, "Request Timeout", "connection closed to make room for another (server at its connection bound)"
        )


class Connections:
    """Every open connection of one server, and the bound on them. Loop thread only, but for
    `count` (read by /metrics)."""

    def __init__(self, limits: HttpLimits, factory: Callable[[], asyncio.Protocol], loop: asyncio.AbstractEventLoop):
        self.limits, self.factory, self.loop = limits, factory, loop
        self._open: dict[asyncio.BaseTransport, Connection] = {}
        self._live: set[Connection] = set()  # every connection not lost yet: open, refused, evicted
        self._lock = threading.Lock()

    def protocol(self) -> Connection:
        conn = Connection(self.factory(), self)
        self._live.add(conn)
        return conn

    def close_all(self) -> None:
        """Close every connection still open, lingering ones included (the server is stopping:
        a linger timer would never fire once its loop stops)."""
        for conn in list(self._live):
            if conn.transport is not None and not conn.lost:
                conn.transport.close()

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._open)

    def admit(self, conn: Connection) -> bool:
        """Whether `conn` may stay: at the bound, the longest-waiting connection that is not
        serving a request is closed for it; if every one serves a request, `conn` gets 503."""
        with self._lock:
            if len(self._open) >= self.limits.max_connections:
                waiting = [c for c in self._open.values() if c.state is not State.BUSY and not c.lost]
                if not waiting:
                    conn._refuse(
                        503,
                        "Service Unavailable",
                        f"Overloaded: {self.limits.max_connections} connections open, each serving a request",
                    )
                    return False
                victim = min(waiting, key=lambda c: (c.state is State.RECEIVING, c.since))
                del self._open[victim.transport]
                victim.evict()
            self._open[conn.transport] = conn
            return True

    def of(self, transport: asyncio.BaseTransport | None) -> Connection | None:
        """The connection a request came on (aiohttp names its transport); None once closed."""
        with self._lock:
            return self._open.get(transport)

    def forget(self, conn: Connection) -> None:
        self._live.discard(conn)
        with self._lock:
            if self._open.get(conn.transport) is conn:
                del self._open[conn.transport]
