"""The router's HTTP routes: POST /generate, /v1/completions and /abort, with their metrics;
VllmRoutes: /v1/completions and /v1/chat/completions through vLLM pairs."""

from disagg import __version__
from disagg.api.fields import Reply
from disagg.api.metrics import PrefillRoutingMetrics, WorkerLoadMetrics, WorkerMetrics
from disagg.api.server import Service, client_gone, default_error_body
from disagg.router import openai
from disagg.router.router import Router
from disagg.router.vllm import ROUTES, VllmRouter


def error_body(path: str, status: int, exc: "BaseException | str") -> dict:
    """OpenAI's error object on the /v1 routes, ours elsewhere."""
    if path.startswith("/v1/"):
        return openai.error_body(status, exc)
    return default_error_body(path, status, exc)


class RouterRoutes:
    def __init__(self, router: Router):
        self.router, self.metrics = router, WorkerMetrics("router")
        self.prefills = PrefillRoutingMetrics(self.metrics.registry)
        self.loads = WorkerLoadMetrics(self.metrics.registry)

    def service(self) -> Service:
        router = self.router
        return Service(
            {
                "/generate": self.generate_route,
                "/v1/completions": openai.Completions(self.generate, router.config.model_name),
                "/abort": self.router.abort,
            },
            self.router.ready,
            self.metrics.registry,
            health=self.health,
            gets={"/v1/models": lambda: openai.models(self.router.config.model_name)},
            error_body=error_body,
            metrics=self.metrics,
            before_scrape=lambda: self.loads.observe(router.load.ranks()),
        )

    def health(self) -> dict:
        return {
            "status": "ok",
            "role": "router",
            "version": __version__,
            "pairs": len(self.router.roster.current()),
            "route": self.router.config.route,
            **({"cache_index": self.router.cache.ranks()} if self.router.cache is not None else {}),
        }

    def generate(self, body: dict, on_prefill=None) -> dict:
        return self.metrics.count(
            lambda: self.router.generate(body, client_gone, on_prefill), lambda out: out["ok"], self._observe
        )

    def generate_route(self, body: dict) -> Reply:
        """A failed request is answered 5xx (or 409 if aborted) with the same JSON body."""
        out = self.generate(body)
        return Reply(out["status"], out)

    def _observe(self, out: dict, ok: bool) -> None:
        if ok:
            self.metrics.seconds("total", out["timings_ms"], "total")
            self.prefills.answered(out)


class VllmRoutes:
    """`--backend vllm`: the OpenAI routes forwarded through a vLLM pair (disagg/router/vllm.py)."""

    def __init__(self, router: VllmRouter):
        self.router, self.metrics = router, WorkerMetrics("router")

    def service(self) -> Service:
        routes = {path: (lambda body, path=path: self.router.forward(path, body)) for path in ROUTES}
        return Service(
            routes,
            self.router.ready,
            self.metrics.registry,
            health=self.health,
            gets={"/v1/models": self.router.models},
            error_body=error_body,
            metrics=self.metrics,
        )

    def health(self) -> dict:
        return {
            "status": "ok",
            "role": "router",
            "backend": "vllm",
            "version": __version__,
            "pairs": len(self.router.config.pairs),
        }
