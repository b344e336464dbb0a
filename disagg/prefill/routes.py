"""A prefill worker's HTTP routes: POST /prefill and /abort, with their metrics."""

from disagg.api.fields import abort_route, optional_int, require_room, require_tokens, stream_layers
from disagg.api.metrics import WorkerMetrics
from disagg.api.server import Service
from disagg.control.messages import MAX_TP_SIZE
from disagg.prefill.server import PrefillServer


class PrefillRoutes:
    def __init__(self, server: PrefillServer):
        self.server, self.metrics = server, WorkerMetrics("prefill")

    def service(self) -> Service:
        return Service(
            {"/prefill": self.prefill, "/abort": abort_route(self.server.abort)},
            lambda: self.server.ready,
            self.metrics.registry,
            health=self.server.health,
            metrics=self.metrics,
            before_scrape=lambda: self.metrics.observe_pool(self.server.available()),
        )

    def prefill(self, body: dict) -> dict:
        room, tokens, stream = require_room(body), require_tokens(body), stream_layers(body)
        decode_tp = optional_int(body, "decode_tp", 0, 0, MAX_TP_SIZE) or None  # the router says it
        return self.metrics.count(
            lambda: self.server.prefill(room, tokens, stream, decode_tp),
            lambda out: out["state"] == "SUCCESS",
            self._observe,
        )

    def _observe(self, out: dict, ok: bool) -> None:
        m = self.metrics
        if ok and "transport" in out:  # (a TP rank holding none of decode's share sends nothing)
            m.bytes.labels("prefill", out["transport"]).inc(out["bytes"])
            m.transfers.labels("prefill", out["mode"], out["transport"]).inc()
            m.ranges.labels("prefill").observe(out["ranges"])
            m.seconds("transfer", out)
        m.seconds("prefill", out)
