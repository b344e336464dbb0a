"""A small JSON-over-HTTP server for every long-running process: /health, /ready, /metrics
and the process's own POST routes. Bad requests get a 4xx with a reason; a failing handler
gets a 500 with its message; the server keeps serving either way.

    400 bad input    404 no route    405 GET of a POST route    408 body not sent in time
    409 refused by the protocol
    499 cancelled (client went away)    502 a worker failed the request (RequestFailed)
    503 overloaded: more than `max_inflight` POSTs at once, more than `max_connections` open
        connections, or the pool stayed full (Retry-After: 1); refused at once, never queued

A route may answer with server-sent events (an EventStream: `data: {json}` per event, then
`data: [DONE]`, connection closed at the end); an error after the first event becomes an
`{"error": ...}` event, since the status line is gone by then.

Nobody can hold the server with connections that send slowly or not at all: a POST's body is
read whole (within READ_TIMEOUT_S) before it takes an in-flight slot, every read of headers
waits at most READ_TIMEOUT_S, an idle keep-alive connection is closed after it, and open
connections are bounded. Why the standard library's server and not an ASGI server or
aiohttp: every route blocks its thread for the whole request (it waits for a transfer), so
an async server would hand each one to a thread pool anyway; with the bounds above the
threads are bounded in number and in time, and there is no dependency to keep up with.
"""

import json
import logging
import select
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from disagg.api.fields import EventStream, Reply, Route
from disagg.errors import BadRequest, Cancelled, ConfigError, DisaggError, Overloaded, RequestFailed

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
READ_TIMEOUT_S = 10.0    # for a request's headers (per read) and for its whole body
PROBE_EVERY_S = 0.5      # how often a half-closed client is asked whether it still listens
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_call = threading.local()  # the connection of the POST this thread serves


def client_gone() -> bool:
    """In a POST handler: whether the client closed its connection (a cancel).

    A client that only half-closed (shut its sending side and still waits for the answer)
    looks the same as a closed one until the server writes: so on end-of-stream an HTTP/1.1
    client gets an interim `100 Continue` (which every HTTP/1.1 client must skip), and a
    closed socket answers it with a reset that the next look sees. HTTP/1.0 has no interim
    answers: there end-of-stream is a cancel."""
    state = getattr(_call, "state", None)
    if state is None:
        return False
    conn, http11, probed = state
    try:
        poller = select.poll()    # not select.select: descriptors past 1024 are common here
        poller.register(conn, select.POLLIN)
        if not poller.poll(0):
            return False          # nothing to read: still there
        if conn.recv(1, socket.MSG_PEEK) != b"":
            return False          # a pipelined next request: still there
        if not http11:
            return True
        now = time.monotonic()
        if now - probed >= PROBE_EVERY_S:
            conn.sendall(_CONTINUE)
            _call.state = (conn, http11, now)
        return False
    except (OSError, ValueError):
        return True               # reset: gone


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` of them; one more is answered 503
    and closed by the accepting thread."""
    daemon_threads = True
    request_queue_size = 1024   # listen backlog: a burst is accepted (or refused) in order, not dropped

    def __init__(self, address, handler, max_connections: int):
        self.max_connections, self._open, self._lock = max_connections, 0, threading.Lock()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        with self._lock:
            full = self._open >= self.max_connections
            self._open += not full
        if full:
            body = json.dumps({"error": f"Overloaded: {self.max_connections} connections open"}).encode()
            try:
                request.settimeout(0.5)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                                % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release()

    def _release(self) -> None:
        with self._lock:
            self._open -= 1


class ApiServer:
    def __init__(self, host: str, port: int, routes: dict[str, Route], ready: Callable[[], bool],
                 registry: CollectorRegistry, before_scrape: Callable[[], None] | None = None,
                 max_inflight: int = 0, unlimited: tuple[str, ...] = ("/abort",),
                 health: Callable[[], dict] | None = None, max_connections: int = 0):
        self.routes, self.ready, self.registry = routes, ready, registry
        self.before_scrape = before_scrape
        self.health = health or (lambda: {"status": "ok"})   # "status" other than "ok": 503
        self.max_inflight = max_inflight     # 0: no limit
        self.unlimited = unlimited           # routes never refused for load (an abort frees load)
        self._slots = threading.BoundedSemaphore(max_inflight) if max_inflight else None
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = READ_TIMEOUT_S   # every read; an idle keep-alive connection ends after it

            def log_message(self, fmt, *args):  # route through logging, not stderr
                log.debug("%s " + fmt, self.address_string(), *args)

            def _send(self, code: int, body: bytes, ctype: str = "application/json", extra: dict | None = None) -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    for name, value in (extra or {}).items():
                        self.send_header(name, value)
                    self.send_header("Content-Length", str(len(body)))
                    if code == 503:
                        self.send_header("Retry-After", "1")
                    if self.close_connection:
                        self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client went away: nothing to tell it
                    self.close_connection = True

            def _json(self, code: int, obj: dict) -> None:
                self._send(code, json.dumps(obj).encode())

            def _events(self, stream: EventStream) -> None:
                """Server-sent events; headers with the first one. Raises what produce raises
                before it (the caller answers with a status); after it, an error event."""
                started = False

                def send(event: dict | None) -> None:
                    nonlocal started
                    if not started:
                        self.send_response(200)
                        self.send_header("Content-Type", "text/event-stream")
                        self.send_header("Cache-Control", "no-cache")
                        self.send_header("Connection", "close")
                        self.end_headers()
                        started = True
                    if event is not None:
                        self.wfile.write(b"data: " + json.dumps(event).encode() + b"\n\n")
                    self.wfile.flush()

                self.close_connection = True   # no length: the end of the stream is the end of the body
                try:
                    stream.produce(send)
                    send(None)
                except Exception as exc:
                    if not started:
                        raise
                    if not isinstance(exc, (DisaggError, OSError)):
                        log.exception("event stream for %s failed", self.path)
                    try:
                        send({"error": {"message": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__}})
                    except OSError:
                        return
                try:
                    self.wfile.write(b"data: [DONE]\n\n")
                except OSError:   # the client went away
                    pass

            def do_GET(self):
                if self.path == "/health":
                    health = api.health()
                    self._json(200 if health.get("status") == "ok" else 503, health)
                elif self.path == "/ready":   # ready() -> bool, or a dict with "ready" and why
                    state = api.ready()
                    body = state if isinstance(state, dict) else {"ready": bool(state)}
                    self._json(200 if body["ready"] else 503, body)
                elif self.path == "/metrics":
                    if api.before_scrape is not None:
                        api.before_scrape()  # gauges read at scrape time, never stale
                    self._send(200, generate_latest(api.registry), CONTENT_TYPE_LATEST)
                elif self.path in api.routes:
                    self._send(405, json.dumps({"error": f"{self.path} takes POST with a JSON body"}).encode(),
                               extra={"Allow": "POST"})
                else:
                    self._json(404, {"error": f"no route {self.path}"})

            def _body(self) -> bytes:
                """The whole body, read within READ_TIMEOUT_S, or BadRequest/TimeoutError."""
                if "Transfer-Encoding" in self.headers:
                    raise BadRequest("send the body with a Content-Length, not a Transfer-Encoding")
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                except ValueError:
                    raise BadRequest("Content-Length must be an integer") from None
                if not 0 <= length <= MAX_BODY_BYTES:
                    raise BadRequest(f"body of {length} bytes refused (at most {MAX_BODY_BYTES})")
                deadline, parts, got = time.monotonic() + READ_TIMEOUT_S, [], 0
                while got < length:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise TimeoutError
                    self.connection.settimeout(left)
                    part = self.rfile.read1(length - got)
                    if not part:
                        raise BadRequest(f"body cut short: {got} of {length} bytes")
                    parts.append(part)
                    got += len(part)
                self.connection.settimeout(READ_TIMEOUT_S)
                return b"".join(parts)

            def do_POST(self):
                try:
                    raw = self._body()
                except TimeoutError:
                    self.close_connection = True
                    return self._json(408, {"error": f"body not sent within {READ_TIMEOUT_S:g} s"})
                except (BadRequest, OSError) as exc:
                    self.close_connection = True
                    return self._json(400, {"error": f"BadRequest: {exc}"})
                route = api.routes.get(self.path)
                if route is None:
                    return self._json(404, {"error": f"no route {self.path}"})
                try:
                    body = json.loads(raw or b"{}")
                    if not isinstance(body, dict):
                        raise BadRequest("body must be a JSON object")
                except (BadRequest, ValueError) as exc:
                    return self._json(400, {"error": f"{type(exc).__name__}: {exc}"})
                except RecursionError:   # e.g. 100,000 nested brackets
                    return self._json(400, {"error": "BadRequest: JSON nested too deeply"})
                limited = api._slots is not None and self.path not in api.unlimited
                if limited and not api._slots.acquire(blocking=False):
                    return self._json(503, {"error": f"Overloaded: {api.max_inflight} requests in flight"})
                _call.state = (self.connection, self.request_version == "HTTP/1.1", float("-inf"))
                try:
                    out = route(body)
                    if isinstance(out, EventStream):
                        self._events(out)
                    elif isinstance(out, Reply):
                        self._json(out.status, out.body)
                    else:
                        self._json(200, out)
                except (BadRequest, ValueError, KeyError, TypeError, OverflowError) as exc:
                    self._json(400, {"error": f"{type(exc).__name__}: {exc}"})
                except Overloaded as exc:
                    self._json(503, {"error": f"Overloaded: {exc}"})
                except Cancelled as exc:
                    self._json(499, {"error": f"Cancelled: {exc}"})
                except RequestFailed as exc:
                    self._json(exc.status, {"error": f"RequestFailed: {exc}"})
                except DisaggError as exc:
                    self._json(409, {"error": f"{type(exc).__name__}: {exc}"})
                except Exception as exc:  # a handler bug must not take the server down
                    log.exception("handler for %s failed", self.path)
                    self._json(500, {"error": f"{type(exc).__name__}: {exc}"})
                finally:
                    _call.state = None
                    if limited:
                        api._slots.release()

        max_connections = max_connections or max(64, 4 * max_inflight)
        try:
            self.httpd = _Server((host, port), Handler, max_connections)
        except OSError as exc:
            raise ConfigError(f"HTTP {host}:{port}: cannot bind ({exc.strerror}); choose another port or 0 for "
                              f"any free one") from None
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)

    def start(self) -> "ApiServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
