"""A decode worker's HTTP routes: POST /decode and /abort, with their metrics; POST
/cache/events (with the prefix cache, disagg/api/cache_route.py, as prefill's): what the cache
holds, by chained page key, for the router's index."""

from disagg.api.cache_route import cache_routes
from disagg.api.fields import abort_route, optional_int, require_room, require_tokens
from disagg.api.metrics import PrefixCacheMetrics, WorkerMetrics
from disagg.api.server import Service
from disagg.decode.server import DecodeServer
from disagg.errors import BadRequest

PHASES = ("bootstrap", "wait", "verify", "decode", "check")


class DecodeRoutes:
    def __init__(self, server: DecodeServer):
        self.server, self.metrics = server, WorkerMetrics("decode")
        self.cache = PrefixCacheMetrics(self.metrics.registry, "decode") if server.cache is not None else None

    def service(self) -> Service:
        return Service(
            {
                "/decode": self.decode,
                "/abort": abort_route(self.server.abort),
                **cache_routes(self.server.cache, self.server.epoch),
            },
            self.server.readiness,
            self.metrics.registry,
            health=self.server.health,
            metrics=self.metrics,
            before_scrape=self._scrape,
            unlimited=("/abort", "/cache/events"),
        )

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
