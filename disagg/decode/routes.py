"""A decode worker's HTTP routes: POST /decode and /abort, with their metrics; POST
/cache/events (with the prefix cache): what the cache holds, by chained page key, for the
router's index (what changed since the router's last look, or everything)."""

from disagg.api.fields import abort_route, optional_int, require_room, require_tokens
from disagg.api.metrics import PrefixCacheMetrics, WorkerMetrics
from disagg.api.server import Service
from disagg.control.cache_events import CacheEvents, encode_events
from disagg.decode.server import DecodeServer
from disagg.errors import BadRequest

PHASES = ("bootstrap", "wait", "verify", "decode", "check")


class DecodeRoutes:
    def __init__(self, server: DecodeServer):
        self.server, self.metrics = server, WorkerMetrics("decode")
        self.cache = PrefixCacheMetrics(self.metrics.registry, "decode") if server.cache is not None else None

    def service(self) -> Service:
        routes = {"/decode": self.decode, "/abort": abort_route(self.server.abort)}
        if self.server.cache is not None:
            routes["/cache/events"] = self.cache_events
        return Service(
            routes,
            self.server.readiness,
            self.metrics.registry,
            health=self.server.health,
            metrics=self.metrics,
            before_scrape=self._scrape,
            unlimited=("/abort", "/cache/events"),
        )

    def cache_events(self, body: dict) -> dict:
        """{"since": the seq of the caller's last answer, or null; "epoch": that answer's}: the
        cache's changes since then, or all of it ("reset": true) when the caller has none or its
        epoch is not ours (we restarted: our seq counts another journal)."""
        since, epoch = body.get("since"), body.get("epoch")
        if since is not None and (type(since) is not int or since < 0):
            raise BadRequest("since must be null or a non-negative int (the seq of your last answer)")
        if epoch != self.server.epoch:
            since = None
        return encode_events(CacheEvents(epoch=self.server.epoch, **self.server.cache.published(since)))

    def _scrape(self) -> None:
        """The pool's free capacity (cached pages nobody uses count as free: a request takes
        them) and the prefix cache's figures."""
        self.metrics.observe_pool(self.server.available())
        if self.cache is not None:
            self.cache.observe(self.server.cache.stats())

    def decode(self, body: dict) -> dict:
        room, tokens = require_room(body), require_tokens(body)
        max_new = optional_int(body, "max_new_tokens", 1, 1, 4096)
        bootstrap = body.get("bootstrap")
        if bootstrap is not None and not (isinstance(bootstrap, str) and 0 < len(bootstrap) <= 256):
            raise BadRequest("bootstrap must be the name or address of a bootstrap this decode is configured with")
        return self.metrics.count(
            lambda: self.server.decode(room, tokens, max_new, bootstrap),
            lambda out: out["state"] == "SUCCESS",
            lambda out, ok: self._observe(out, ok, len(tokens)),
        )

    def _observe(self, out: dict, ok: bool, prompt_tokens: int) -> None:
        if ok:
            self.metrics.bytes.labels("decode", out["transport"]).inc(out["bytes"])
            if self.cache is not None:
                self.cache.answered(out, prompt_tokens)
            for phase in PHASES:
                self.metrics.seconds(phase, out)
