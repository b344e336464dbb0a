"""Prometheus metrics of one worker process (its own registry, so tests can run many).

Every name ends in its unit (`_seconds`, `_bytes`, `_tokens`, ...; a counter in `_total`) and
one metric holds one unit: the pool's free capacity is a gauge per unit (tokens of page pools,
per-request state slots, aux rows), with the allocator as a label. The `_created` series that
prometheus_client adds to every counter and histogram are not exported: they double the
output and nothing here reads them (a Prometheus server tracks resets itself)."""

import threading
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.parser import text_string_to_metric_families

from disagg.errors import Cancelled, Overloaded

disable_created_metrics()  # process-wide; read when a registry is scraped, so it holds for every metric

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
# the unit a pool figure is counted in (the end of its key: "full_tokens", "mamba_slots", "aux_rows")
POOL_UNITS = {
    "tokens": "free tokens in page pools, by allocator",
    "slots": "free per-request state slots, by allocator",
    "rows": "free aux rows (one per request), by allocator",
}


class WorkerMetrics:
    def __init__(self, role: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("disagg_requests_total", "requests by outcome", ["role", "outcome"], registry=r)
        self.failures = Counter("disagg_failures_total", "failed requests by reason", ["role", "reason"], registry=r)
        self.bytes = Counter(
            "disagg_transfer_bytes_total", "KV bytes moved, by transport", ["role", "transport"], registry=r
        )
        self.transfers = Counter(
            "disagg_transfers_total", "transfers by mode and transport", ["role", "mode", "transport"], registry=r
        )
        self.latency = Histogram(
            "disagg_phase_seconds", "latency per phase", ["role", "phase"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.ranges = Histogram(
            "disagg_transfer_ranges",
            "transport ranges per transfer",
            ["role"],
            buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536),
            registry=r,
        )
        self.pool_free = {
            unit: Gauge(f"disagg_pool_free_{unit}", text, ["role", "allocator"], registry=r)
            for unit, text in POOL_UNITS.items()
        }
        self.inflight = Gauge("disagg_inflight_requests", "requests being served (queue depth)", ["role"], registry=r)
        self.capacity = Gauge(
            "disagg_capacity_requests", "requests this process takes at once (--max-inflight)", ["role"], registry=r
        )
        self.connections = Gauge(
            "disagg_http_connections_requests", "open HTTP connections (each may carry a request)", ["role"], registry=r
        )
        self.answers = Counter(
            "disagg_http_answers_total",
            "HTTP answers by route and status (400s and 503s too)",
            ["role", "route", "status"],
            registry=r,
        )
        self.role = role

    def observe_pool(self, available: dict[str, int]) -> None:
        """Set the free-capacity gauges from a pool's `available()` ({"full_tokens": 4096, ...})."""
        for key, value in available.items():
            allocator, unit = pool_key(key)
            self.pool_free[unit].labels(self.role, allocator).set(value)

    def count(
        self,
        call: Callable[[], dict],
        succeeded: Callable[[dict], bool],
        observe: Callable[[dict, bool], None] | None = None,
    ) -> dict:
        """One API call: the in-flight gauge around it, an Overloaded refusal or a call its
        client gave up on (Cancelled: HTTP 499, answered to nobody) counted and raised on, the
        outcome counted (success, or failure by reason), then `observe(out, ok)` for the
        role's own figures."""
        self.inflight.labels(self.role).inc()
        try:
            out = call()
        except Overloaded:
            self.failure("overloaded")
            raise
        except Cancelled:
            self.failure("cancelled")
            raise
        finally:
            self.inflight.labels(self.role).dec()
        ok = succeeded(out)
        if ok:
            self.requests.labels(self.role, "success").inc()
        else:
            self.failure(out.get("reason") or "unknown")
        if observe is not None:
            observe(out, ok)
        return out

    def seconds(self, phase: str, out: dict, key: str | None = None) -> None:
        """Observe out[key or phase_ms] (milliseconds) as the phase's latency, if present."""
        ms = out.get(key or f"{phase}_ms")
        if ms is not None:
            self.latency.labels(self.role, phase).observe(ms / 1e3)

    def failure(self, reason: str) -> None:
        """Count a failure under a coarse reason: the side it names and its kind (bounded label
        cardinality)."""
        self.requests.labels(self.role, "failed").inc()
        self.failures.labels(self.role, failure_label(reason)).inc()


# the kind of a failure, by what its reason says (first match); anything else is "other"
FAILURE_KINDS = (
    ("cancel", "cancelled"),
    ("abort", "cancelled"),
    ("deadline", "timeout"),
    ("timed out", "timeout"),
    ("no answer", "timeout"),
    ("unreachable", "unreachable"),
    ("refused", "refused"),
    ("layout", "layout"),
    ("overloaded", "overloaded"),
    ("verif", "verify"),
    ("check", "check"),
    ("outofspace", "out_of_space"),
    ("out of space", "out_of_space"),
    ("malformed", "malformed"),
    ("transfer", "transfer"),
    ("silent", "peer_lost"),
    ("lost", "peer_lost"),
)


def failure_label(reason: str) -> str:
    """ "decode failed: TRANSFERRING deadline of 30 s passed" -> "decode:timeout"."""
    first = reason.split(":")[0].split(" ")[0][:40].lower()
    side = first if first in ("prefill", "decode", "router") else ""
    text = reason.lower()
    kind = next((k for word, k in FAILURE_KINDS if word in text), "other")
    return f"{side}:{kind}" if side else kind


def pool_key(key: str) -> tuple[str, str]:
    """ "full_tokens" -> ("full", "tokens"); ValueError for a figure that names no unit."""
    allocator, _, unit = key.rpartition("_")
    if not allocator or unit not in POOL_UNITS:
        raise ValueError(f"pool figure {key!r} must end in its unit, one of {', '.join(POOL_UNITS)}")
    return allocator, unit


class PrefixCacheMetrics:
    """A worker's prefix cache (kvpool.cache; role decode: positions not received, prefill:
    positions not computed): what requests took from it, out of how many prompt positions,
    and what that saved (per answered request: hit / queried is the hit rate), what it holds
    and evicted (read off its stats at each scrape)."""

    def __init__(self, registry: CollectorRegistry, role: str):
        r = registry
        self.hit = Counter(
            "disagg_prefix_cache_hit_tokens_total",
            "prompt positions requests took from the prefix cache (succeeded requests)",
            ["role"],
            registry=r,
        )
        self.queried = Counter(
            "disagg_prefix_cache_queried_tokens_total",
            "prompt positions of the requests that "
            "looked the prefix cache up (succeeded requests; hit / queried: the hit rate)",
            ["role"],
            registry=r,
        )
        self.saved = Counter(
            "disagg_prefix_cache_saved_bytes_total",
            "KV bytes not received thanks to the prefix cache (succeeded requests)",
            ["role"],
            registry=r,
        )
        self.evicted = Counter(
            "disagg_prefix_cache_evicted_tokens_total", "cached positions evicted to make room", ["role"], registry=r
        )
        self.cached = Gauge("disagg_prefix_cache_tokens", "positions the prefix cache holds", ["role"], registry=r)
        self.role, self._evicted_seen = role, 0

    def answered(self, out: dict, prompt_tokens: int) -> None:
        """A request of `prompt_tokens` that succeeded: its prefix_tokens and reused_bytes
        (the worker's answer; prefill's says no bytes)."""
        self.hit.labels(self.role).inc(out.get("prefix_tokens", 0))
        self.queried.labels(self.role).inc(prompt_tokens)
        self.saved.labels(self.role).inc(out.get("reused_bytes", 0))

    def observe(self, stats: dict[str, int]) -> None:
        """Before a scrape: the cache's stats (PrefixCache.stats)."""
        self.cached.labels(self.role).set(stats["cached_tokens"])
        self.evicted.labels(self.role).inc(max(0, stats["evicted_tokens"] - self._evicted_seen))
        self._evicted_seen = max(self._evicted_seen, stats["evicted_tokens"])


class PrefillRoutingMetrics:
    """The router's KV-aware choice of a prefill (`--route kv`): the prompt tokens its cache
    index predicted the chosen prefill would not compute, and what that prefill then said it
    did not compute, over the succeeded requests that have both (answer fields
    prefill_cached_predicted and prefill_cached_tokens). Equal rates: the index is fresh; a
    gap: requests were routed on a stale or wrong picture (a cache evicted meanwhile, a
    worker that misreports)."""

    def __init__(self, registry: CollectorRegistry):
        self.tokens = Counter(
            "disagg_router_prefill_cached_tokens_total",
            "prompt tokens the chosen prefill would not compute: predicted by the router's "
            "index, reported by the prefill (succeeded requests with both)",
            ["source"],
            registry=registry,
        )

    def answered(self, out: dict) -> None:
        predicted, reported = out.get("prefill_cached_predicted"), out.get("prefill_cached_tokens")
        if predicted is not None and reported is not None:
            self.tokens.labels("predicted").inc(predicted)
            self.tokens.labels("reported").inc(reported)


class WorkerLoadMetrics:
    """What the router believes of each worker rank's load (disagg/router/load.py: its own
    requests there, and what the rank's last report held of other routers'), the figure
    `--route kv` weighs: one series per rank the router knows, gone once no pair names the rank."""

    def __init__(self, registry: CollectorRegistry):
        self.tokens = Gauge(
            "disagg_router_worker_load_tokens",
            "prompt tokens queued and running on a worker rank, as the router believes it",
            ["worker"],
            registry=registry,
        )
        self._shown: set[str] = set()
        self._lock = threading.Lock()  # (scrapes may come at once)

    def observe(self, ranks: dict[str, int]) -> None:
        """Before a scrape: every rank's load (LoadBook.ranks)."""
        with self._lock:
            for url in self._shown - ranks.keys():
                self.tokens.remove(url)
            for url, tokens in ranks.items():
                self.tokens.labels(url).set(tokens)
            self._shown = set(ranks)


# ---- readers of a /metrics page (tests, scripts/soak.py) ----------------------------------------
def pool_free(text: str) -> dict[str, float]:
    """The free-capacity gauges of an exposition text, keyed as the pool names them ("full_tokens")."""
    names = {f"disagg_pool_free_{unit}": unit for unit in POOL_UNITS}
    return {
        f"{s.labels['allocator']}_{names[f.name]}": s.value
        for f in text_string_to_metric_families(text)
        if f.name in names
        for s in f.samples
    }


def inflight(text: str) -> float:
    """Requests being served, summed over the page's roles (0 before the first one)."""
    return sum(
        s.value for f in text_string_to_metric_families(text) if f.name == "disagg_inflight_requests" for s in f.samples
    )
