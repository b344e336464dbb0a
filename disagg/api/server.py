"""HTTP for every long-running process, on aiohttp: /health, /ready, /metrics (GET or HEAD)
and the process's own POST routes, each a function of a JSON body.

Why aiohttp, not uvicorn + starlette: it embeds in a process that is not built around it
(one event loop on one thread, started and stopped with the worker; uvicorn wants to own the
process and its signals), it is server and client in one (the router's calls to workers can
move onto the same loop), and it parses HTTP, keep-alive, chunked bodies, `Expect:
100-continue` and event streams the way clients expect, kept up by people who track what
clients and attackers do. What it lacks, a deadline on a request's whole
receipt and a bound on open connections, is `connections.py`; what we own here is the
mapping from a route's outcome to an answer.

A route is a plain function (it blocks: it waits for a transfer), so it runs on a thread
of `routes_pool`; /health, /ready and /metrics run on their own small pool, so a server
full of requests still answers its probes. One table maps an exception to a status:

    400 bad input (BadRequest, ValueError, KeyError, TypeError, OverflowError)
    404 no route    405 a POST route asked with another method    408 request not sent in time
    409 refused by the protocol (any other DisaggError)    413 body too large
    499 cancelled (the client went away)    5xx a worker failed the request (RequestFailed)
    503 overloaded: more than `max_inflight` POSTs at once, the connection bound full of
        requests, or the pool stayed full; or unavailable: every pair is down (Retry-After:
        1); refused at once, never queued
    500 anything else (a bug: logged with its traceback; the server keeps serving)

A route may answer with server-sent events (an EventStream: `data: {json}` per event, then
`data: [DONE]`); an error after the first event becomes an `{"error": ...}` event, since the
status line is gone by then.
"""

import asyncio
import concurrent.futures
import contextvars
import json
import logging
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from disagg.api.connections import Connection, Connections, HttpLimits
from disagg.api.fields import EventStream, Reply, Route
from disagg.api.metrics import WorkerMetrics
from disagg.errors import BadRequest, Cancelled, ConfigError, DisaggError, Overloaded, RequestFailed, Unavailable

log = logging.getLogger(__name__)

__all__ = ["ApiServer", "HttpLimits", "Service", "client_gone", "default_error_body", "listen"]

STATUS: tuple[tuple[type | tuple[type, ...], int], ...] = (  # first match wins
    ((BadRequest, ValueError, KeyError, TypeError, OverflowError), 400),
    ((Overloaded, Unavailable), 503),
    (Cancelled, 499),
    (DisaggError, 409),  # (RequestFailed carries its own status)
)
PROBES = ("/health", "/ready", "/metrics")
STOP_GRACE_S = 3.0  # on stop, how long requests under way may take to be answered
_conn: contextvars.ContextVar[Connection | None] = contextvars.ContextVar("http_connection", default=None)


class BodyTooLarge(BadRequest):
    """A body over the server's bound (HTTP 413): refused before it is read, or when it grows past it."""


def client_gone() -> bool:
    """In a route: whether its client closed the connection (a cancel)."""
    conn = _conn.get()
    return conn is not None and conn.gone()


def status_of(exc: BaseException) -> int:
    if isinstance(exc, RequestFailed):
        return exc.status
    for kinds, status in STATUS:
        if isinstance(exc, kinds):
            return status
    return 500


def default_error_body(path: str, status: int, exc: BaseException | str) -> dict:
    return {"error": exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"}


@dataclass(frozen=True)
class Service:
    """What a process serves: its POST routes and its probes.

    `ready()` -> bool, or a dict with "ready" and "why"; `health()` -> a dict whose "status"
    other than "ok" answers 503; `before_scrape` sets gauges read at scrape time; routes in
    `unlimited` are never refused for load (an abort frees load); `gets` are GET routes
    beside the probes (a function returning the JSON body); `error_body(path, status, exc)`
    shapes a failure's JSON (the OpenAI routes want OpenAI's error object); with `metrics`
    (the role's, on `registry`), every answer is counted by route and status, and open
    connections and the in-flight bound are gauges."""

    routes: dict[str, Route]
    ready: Callable[[], "bool | dict"]
    registry: CollectorRegistry
    health: Callable[[], dict] = lambda: {"status": "ok"}
    before_scrape: Callable[[], None] | None = None
    unlimited: tuple[str, ...] = ("/abort",)
    gets: dict[str, Callable[[], dict]] = field(default_factory=dict)
    error_body: Callable[[str, int, "BaseException | str"], dict] = default_error_body
    metrics: "WorkerMetrics | None" = None  # where the server counts its answers, connections, capacity


def _json(status: int, body: dict) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(body).encode(),
        content_type="application/json",
        headers={"Retry-After": "1"} if status == 503 else None,
    )


def listen(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: any free port), or ConfigError. Processes bind it
    first, so a busy port is found before a pool is allocated."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
        return socket.create_server((host, port), family=family, backlog=1024)
    except OSError as exc:
        raise ConfigError(
            f"HTTP {host}:{port}: cannot bind ({exc.strerror or exc}); choose another port or 0 for any free one"
        ) from None


class _Gone(web.StreamResponse):
    """The answer to a request whose connection this layer already answered and ended (evicted
    at the bound while aiohttp parsed it): nothing may be written there (aiohttp drops an answer
    whose preparation meets a ConnectionError, quietly)."""

    async def prepare(self, request):
        raise ConnectionResetError("the connection was already answered and ended by this server")


class ApiServer:
    """Serves `service` on `listener` (a socket from listen(), or (host, port) to bind now)
    from start() to stop(), on a thread of its own."""

    def __init__(
        self, listener: "socket.socket | tuple[str, int]", service: Service, limits: HttpLimits = HttpLimits()
    ):
        self.service, self.limits = service, limits
        self._sock = listener if isinstance(listener, socket.socket) else listen(*listener)
        self.port = self._sock.getsockname()[1]
        self._slots = threading.BoundedSemaphore(limits.max_inflight) if limits.max_inflight else None
        self.routes_pool = ThreadPoolExecutor(limits.max_connections, thread_name_prefix="http-route")
        self._probes = ThreadPoolExecutor(4, thread_name_prefix="http-probe")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="http", daemon=True)
        app = web.Application(client_max_size=limits.max_body_bytes)
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(
            app, handle_signals=False, access_log=None, keepalive_timeout=limits.idle_s, shutdown_timeout=STOP_GRACE_S
        )
        self.connections: Connections | None = None
        self._server: asyncio.AbstractServer | None = None

    def start(self) -> "ApiServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()
        return self

    def stop(self) -> None:
        """Stop taking connections; requests under way get STOP_GRACE_S to be answered."""
        if self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(STOP_GRACE_S + 5)
            except (TimeoutError, concurrent.futures.TimeoutError):
                log.warning("HTTP server: requests still under way after %g s; stopping without them", STOP_GRACE_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        if not self._loop.is_running():
            self._loop.close()
        self._sock.close()
        self.routes_pool.shutdown(wait=False, cancel_futures=True)
        self._probes.shutdown(wait=False, cancel_futures=True)

    async def _start(self) -> None:
        await self._runner.setup()
        self.connections = Connections(self.limits, self._runner.server, self._loop)
        self._server = await self._loop.create_server(self.connections.protocol, sock=self._sock)

    async def _stop(self) -> None:
        self._server.close()
        await self._runner.cleanup()
        self.connections.close_all()  # what aiohttp does not hold: lingering and refused connections
        for _ in range(2):  # a transport's close completes on the loop's next turns: let it run
            await asyncio.sleep(0)

    # --- one request
    async def _handle(self, request: web.Request) -> web.StreamResponse:
        conn = self.connections.of(request.transport)
        if conn is None:  # closed (evicted and answered 408, or the client left) before it was routed
            return _Gone()
        try:
            response = await self._route(request, conn)
        finally:
            conn.answered()
        if conn.eof:
            response.force_close()  # a client that half-closed: answer, then close
        self._count(request.path, response.status)
        return response

    def _count(self, path: str, status: int) -> None:
        m = self.service.metrics
        if m is not None:
            known = path in self.service.routes or path in self.service.gets or path in PROBES
            m.answers.labels(m.role, path if known else "other", str(status)).inc()

    async def _route(self, request: web.Request, conn: Connection) -> web.StreamResponse:
        if request.method in ("GET", "HEAD"):
            conn.received()
            return await self._get(request.path)
        route = self.service.routes.get(request.path)
        if route is None or request.method != "POST":
            conn.received()
            return (
                self._error(request.path, 404, f"no route {request.path}")
                if route is None
                else self._error(request.path, 405, f"{request.path} takes POST with a JSON body")
            )
        conn.routing(request.version >= (1, 1))
        return await self._post(request, conn, route)

    async def _get(self, path: str) -> web.Response:
        if path == "/metrics":
            return await self._loop.run_in_executor(self._probes, self._metrics)
        if path in PROBES[:2]:
            return await self._loop.run_in_executor(self._probes, self._probe, path)
        if path in self.service.gets:
            return _json(200, self.service.gets[path]())
        if path in self.service.routes:
            response = self._error(path, 405, f"{path} takes POST with a JSON body")
            response.headers["Allow"] = "POST"
            return response
        return self._error(path, 404, f"no route {path}")

    def _error(self, path: str, status: int, exc: BaseException | str) -> web.Response:
        return _json(status, self.service.error_body(path, status, exc))

    def _probe(self, path: str) -> web.Response:
        if path == "/health":
            health = self.service.health()
            return _json(200 if health.get("status") == "ok" else 503, health)
        state = self.service.ready()
        body = state if isinstance(state, dict) else {"ready": bool(state)}
        return _json(200 if body["ready"] else 503, body)

    def _metrics(self) -> web.Response:
        if self.service.before_scrape is not None:
            self.service.before_scrape()  # gauges read at scrape time, never stale
        m = self.service.metrics
        if m is not None:
            m.connections.labels(m.role).set(self.connections.count)
            m.capacity.labels(m.role).set(self.limits.max_inflight)
        return web.Response(body=generate_latest(self.service.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _post(self, request: web.Request, conn: Connection, route: Route) -> web.StreamResponse:
        try:
            body = await self._body(request, conn)
        except BadRequest as exc:
            response = self._error(request.path, 413 if isinstance(exc, BodyTooLarge) else 400, exc)
            response.force_close()
            return response
        limited = self._slots is not None and request.path not in self.service.unlimited
        if limited and not self._slots.acquire(blocking=False):
            return self._error(request.path, 503, f"Overloaded: {self.limits.max_inflight} requests in flight")
        try:
            return await self._call(request, conn, route, body)
        finally:
            if limited:
                self._slots.release()

    async def _body(self, request: web.Request, conn: Connection) -> dict:
        """The request's JSON object, or BadRequest. Its receipt is bounded by the connection's
        deadline, which answers 408 itself."""
        length = request.content_length
        if length is not None and length > self.limits.max_body_bytes:
            raise BodyTooLarge(f"body of {length} bytes refused (at most {self.limits.max_body_bytes})")
        read = asyncio.ensure_future(request.read())
        ended = asyncio.ensure_future(conn.eof_event.wait())
        await asyncio.wait({read, ended}, return_when=asyncio.FIRST_COMPLETED)
        ended.cancel()
        if not read.done():  # every byte sent came before the end of the stream: none will follow
            read.cancel()
            raise BadRequest("body cut short: the connection ended before the whole body arrived")
        try:
            raw = read.result()
        except web.HTTPRequestEntityTooLarge:
            raise BodyTooLarge(f"body refused: more than {self.limits.max_body_bytes} bytes") from None
        except (ConnectionError, asyncio.CancelledError):
            raise BadRequest("body cut short: the connection ended before the whole body arrived") from None
        conn.received()
        try:
            body = json.loads(raw or b"{}")
        except ValueError as exc:
            raise BadRequest(f"body is not JSON: {exc}") from None
        except RecursionError:  # e.g. 100,000 nested brackets
            raise BadRequest("JSON nested too deeply") from None
        if not isinstance(body, dict):
            raise BadRequest("body must be a JSON object")
        return body

    async def _call(self, request: web.Request, conn: Connection, route: Route, body: dict) -> web.StreamResponse:
        _conn.set(conn)
        try:
            out = await self._loop.run_in_executor(self.routes_pool, contextvars.copy_context().run, route, body)
            if isinstance(out, EventStream):
                return await self._events(request, conn, out)
            if isinstance(out, Reply):
                return _json(out.status, out.body)
            return _json(200, out)
        except Exception as exc:
            status = status_of(exc)
            if status == 500:  # a route's bug must not take the server down
                log.error("handler for %s failed", request.path, exc_info=exc)
            return self._error(request.path, status, exc)

    async def _events(self, request: web.Request, conn: Connection, stream: EventStream) -> web.StreamResponse:
        """Runs `stream.produce` on a route thread; its events go out from this loop."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        response.force_close()  # no length: the end of the stream is the end of the body
        loop = self._loop

        async def write(event: dict | None) -> None:
            if not response.prepared:
                conn.started()
                await response.prepare(request)
            if event is not None:
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")

        def send(event: dict | None) -> None:
            asyncio.run_coroutine_threadsafe(write(event), loop).result()

        def produce() -> None:
            stream.produce(send)
            send(None)

        try:
            await loop.run_in_executor(self.routes_pool, contextvars.copy_context().run, produce)
        except Exception as exc:
            if not response.prepared:
                raise
            if not isinstance(exc, (DisaggError, OSError)):
                log.error("event stream for %s failed", request.path, exc_info=exc)
            if isinstance(exc, OSError):
                return response  # the client went away: nothing to tell it
            await write(self.service.error_body(request.path, status_of(exc), exc))
        try:
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except OSError:
            pass
        return response
