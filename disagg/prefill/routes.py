"""A prefill worker's HTTP routes: POST /prefill and /abort, with their metrics; POST
/cache/events (with the prefix cache, disagg/api/cache_route.py, as decode's): what the cache
holds, by chained page key, for the router's index (`--route kv` weighs what a prefill would
not compute)."""

from disagg.api.cache_route import cache_routes
from disagg.api.fields import abort_route, optional_int, require_room, require_tokens, stream_layers
from disagg.api.metrics import PrefixCacheMetrics, WorkerMetrics
from disagg.api.server import Service
from disagg.control.messages import MAX_TP_SIZE
from disagg.prefill.server import PrefillServer


class PrefillRoutes:
    def __init__(self, server: PrefillServer):
        self.server, self.metrics = server, WorkerMetrics("prefill")
        self.cache = PrefixCacheMetrics(self.metrics.registry, "prefill") if server.cache is not None else None

    def service(self) -> Service:
        return Service(
            {
                "/prefill": self.prefill,
                "/abort": abort_route(self.server.abort),
                **cache_routes(self.server.cache, self.server.epoch),
            },
            lambda: self.server.ready,
            self.metrics.registry,
            health=self.server.health,
            metrics=self.metrics,
            before_scrape=self._before_scrape,
            unlimited=("/abort", "/cache/events"),
        )

    def _before_scrape(self) -> None:
        """The pool's free capacity (cached pages nobody uses count as free) and the prefix
        cache's figures."""
        self.metrics.observe_pool(self.server.available())
        if self.cache is not None:
            self.cache.observe(self.server.cache.stats())

    def prefill(self, body: dict) -> dict:
        room, tokens, stream = require_room(body), require_tokens(body), stream_layers(body)
        decode_tp = optional_int(body, "decode_tp", 0, 0, MAX_TP_SIZE) or None  # the router says it
        return self.metrics.count(
            lambda: self.server.prefill(room, tokens, stream, decode_tp),
            lambda out: out["state"] == "SUCCESS",
            lambda out, ok: self._observe(out, ok, len(tokens)),
        )

    def _observe(self, out: dict, ok: bool, prompt_tokens: int) -> None:
        m = self.metrics
        if ok and self.cache is not None:  # prefix_tokens: the positions it did not compute
            self.cache.answered(out, prompt_tokens)
        if ok and "transport" in out:  # (a TP rank holding none of decode's share sends nothing)
            m.bytes.labels("prefill", out["transport"]).inc(out["bytes"])
            m.transfers.labels("prefill", out["mode"], out["transport"]).inc()
            m.ranges.labels("prefill").observe(out["ranges"])
            m.seconds("transfer", out)
        m.seconds("prefill", out)
