"""A small JSON-over-HTTP server for every long-running process: /health, /ready, /metrics
and the process's own POST routes. Bad requests get a 4xx with a reason; a failing handler
gets a 500 with its message; the server keeps serving either way.

    400 bad input    409 refused by the protocol    499 cancelled (client went away)
    503 overloaded: more than `max_inflight` POSTs at once, or the pool stayed full
        (Retry-After: 1); refused at once, never queued without bound
"""

import json
import logging
import select
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from disagg.errors import BadRequest, Cancelled, DisaggError, Overloaded

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 << 20
Route = Callable[[dict], dict]


_call = threading.local()


def client_gone() -> bool:
    """In a POST handler: whether the client closed its connection (a cancel)."""
    conn = getattr(_call, "connection", None)
    if conn is None:
        return False
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


class ApiServer:
    def __init__(self, host: str, port: int, routes: dict[str, Route], ready: Callable[[], bool],
                 registry: CollectorRegistry, before_scrape: Callable[[], None] | None = None,
                 max_inflight: int = 0, unlimited: tuple[str, ...] = ("/abort",)):
        self.routes, self.ready, self.registry = routes, ready, registry
        self.before_scrape = before_scrape
        self.max_inflight = max_inflight     # 0: no limit
        self.unlimited = unlimited           # routes never refused for load (an abort frees load)
        self._slots = threading.BoundedSemaphore(max_inflight) if max_inflight else None
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):  # route through logging, not stderr
                log.debug("%s " + fmt, self.address_string(), *args)

            def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    if code == 503:
                        self.send_header("Retry-After", "1")
                    self.end_headers()
                    self.wfile.write(body)
                except OSError:  # the client went away: nothing to tell it
                    self.close_connection = True

            def _json(self, code: int, obj: dict) -> None:
                self._send(code, json.dumps(obj).encode())

            def do_GET(self):
                if self.path == "/health":
                    self._json(200, {"status": "ok"})
                elif self.path == "/ready":
                    ok = api.ready()
                    self._json(200 if ok else 503, {"ready": ok})
                elif self.path == "/metrics":
                    if api.before_scrape is not None:
                        api.before_scrape()  # gauges read at scrape time, never stale
                    self._send(200, generate_latest(api.registry), CONTENT_TYPE_LATEST)
                else:
                    self._json(404, {"error": f"no route {self.path}"})

            def do_POST(self):
                route = api.routes.get(self.path)
                if route is None:
                    return self._json(404, {"error": f"no route {self.path}"})
                limited = api._slots is not None and self.path not in api.unlimited
                if limited and not api._slots.acquire(blocking=False):
                    self.close_connection = True   # the body is left unread
                    return self._json(503, {"error": f"Overloaded: {api.max_inflight} requests in flight"})
                _call.connection = self.connection
                try:
                    length = int(self.headers.get("Content-Length", "0"))
                    if not 0 <= length <= MAX_BODY_BYTES:
                        raise BadRequest(f"body of {length} bytes refused")
                    body = json.loads(self.rfile.read(length) or b"{}")
                    if not isinstance(body, dict):
                        raise BadRequest("body must be a JSON object")
                    self._json(200, route(body))
                except (BadRequest, ValueError, KeyError, TypeError, OverflowError) as exc:
                    self._json(400, {"error": f"{type(exc).__name__}: {exc}"})
                except RecursionError:   # e.g. 100,000 nested brackets
                    self._json(400, {"error": "BadRequest: JSON nested too deeply"})
                except Overloaded as exc:
                    self._json(503, {"error": f"Overloaded: {exc}"})
                except Cancelled as exc:
                    self._json(499, {"error": f"Cancelled: {exc}"})
                except DisaggError as exc:
                    self._json(409, {"error": f"{type(exc).__name__}: {exc}"})
                except Exception as exc:  # a handler bug must not take the server down
                    log.exception("handler for %s failed", self.path)
                    self._json(500, {"error": f"{type(exc).__name__}: {exc}"})
                finally:
                    _call.connection = None
                    if limited:
                        api._slots.release()

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)

    def start(self) -> "ApiServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def require(body: dict, key: str, kind: type):
    if key not in body:
        raise BadRequest(f"missing field {key!r}")
    value = body[key]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        raise BadRequest(f"field {key!r} must be {kind.__name__}")
    return value


def optional_int(body: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = body.get(key, default)
    if type(value) is not int or not lo <= value <= hi:
        raise BadRequest(f"{key} must be an int in [{lo}, {hi}]")
    return value


def abort_route(abort: Callable[[int, str], dict]) -> Route:
    """POST /abort {room, reason?} for a worker."""
    return lambda body: abort(require_room(body), str(body.get("reason", "no reason given"))[:500])


def optional_endpoint(body: dict, key: str) -> str | None:
    """A ZMQ tcp://HOST:PORT endpoint, or None; anything else is a BadRequest."""
    value = body.get(key)
    if value is None:
        return None
    host, sep, port = value.removeprefix("tcp://").rpartition(":") if isinstance(value, str) else ("", "", "")
    if not (isinstance(value, str) and value.startswith("tcp://") and sep and host and port.isdigit()
            and 0 < int(port) < 65536 and len(value) <= 256 and not any(c.isspace() for c in value)):
        raise BadRequest(f"{key} must be tcp://HOST:PORT")
    return value


def require_room(body: dict) -> int:
    room = require(body, "room", int)
    if not 0 <= room < 1 << 63:
        raise BadRequest("room must be in [0, 2^63)")
    return room


def require_tokens(body: dict, key: str = "token_ids", max_tokens: int = 1 << 20) -> np.ndarray:
    """A non-empty 1-D list of token ids in [0, 2^31) as an int64 array, or BadRequest."""
    value = require(body, key, list)
    if not 0 < len(value) <= max_tokens:
        raise BadRequest(f"{key} must hold 1 to {max_tokens} tokens")
    if not all(type(t) is int for t in value):
        raise BadRequest(f"{key} must be a list of ints")
    tokens = np.asarray(value, dtype=np.int64)
    if tokens.min() < 0 or tokens.max() >= 1 << 31:
        raise BadRequest(f"{key} must be in [0, 2^31)")
    return tokens
