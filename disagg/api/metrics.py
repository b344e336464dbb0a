"""Prometheus metrics of one worker process (its own registry, so tests can run many)."""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from disagg.errors import Overloaded

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class WorkerMetrics:
    def __init__(self, role: str):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("disagg_requests_total", "requests by outcome", ["role", "outcome"], registry=r)
        self.failures = Counter("disagg_failures_total", "failed requests by reason", ["role", "reason"], registry=r)
        self.bytes = Counter("disagg_transfer_bytes_total", "KV bytes moved, by transport", ["role", "transport"],
                             registry=r)
        self.transfers = Counter("disagg_transfers_total", "transfers by mode and transport",
                                 ["role", "mode", "transport"], registry=r)
        self.latency = Histogram("disagg_phase_seconds", "latency per phase", ["role", "phase"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.ranges = Histogram("disagg_transfer_ranges", "transport ranges per transfer", ["role"],
                                buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536), registry=r)
        self.pool_free = Gauge("disagg_pool_free", "free pool capacity", ["role", "allocator"], registry=r)
        self.inflight = Gauge("disagg_requests_inflight", "requests being served (queue depth)", ["role"], registry=r)
        self.role = role

    def observe_pool(self, available: dict[str, int]) -> None:
        for name, value in available.items():
            self.pool_free.labels(self.role, name).set(value)

    def count(self, call: Callable[[], dict], succeeded: Callable[[dict], bool],
              observe: Callable[[dict, bool], None] | None = None) -> dict:
        """One API call: the in-flight gauge around it, an Overloaded refusal counted (and
        raised on), the outcome counted (success, or failure by reason), then `observe(out,
        ok)` for the role's own figures."""
        self.inflight.labels(self.role).inc()
        try:
            out = call()
        except Overloaded:
            self.failure("overloaded")
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
        """Count a failure under a coarse reason (the first word: bounded label cardinality)."""
        self.requests.labels(self.role, "failed").inc()
        self.failures.labels(self.role, reason.split(":")[0].split(" ")[0][:40] or "unknown").inc()
