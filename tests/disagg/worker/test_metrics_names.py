"""The /metrics page of a worker: a unit in every name, one unit per metric, no `_created`."""

import re

import pytest
from prometheus_client import generate_latest

from disagg.api.metrics import PrefillRoutingMetrics, PrefixCacheMetrics, WorkerMetrics, inflight, pool_free

POOL = {"full_tokens": 4096, "swa_tokens": 512, "mamba_slots": 7, "aux_rows": 8}  # a HybridPool's available()
UNITS = ("_seconds", "_bytes", "_tokens", "_slots", "_rows", "_requests", "_ranges")


def scraped(m: WorkerMetrics) -> str:
    return generate_latest(m.registry).decode()


def busy_worker() -> tuple[WorkerMetrics, str]:
    """A decode worker that served one request and failed one, every metric observed once."""
    m = WorkerMetrics("decode")
    m.observe_pool(POOL)
    m.count(lambda: {"state": "SUCCESS", "wait_ms": 12.0}, lambda out: True, lambda out, ok: m.seconds("wait", out))
    m.count(lambda: {"state": "FAILED", "reason": "TransferError: reset"}, lambda out: False)
    m.bytes.labels("decode", "mooncake").inc(1 << 20)
    m.transfers.labels("decode", "direct", "mooncake").inc()
    m.ranges.labels("decode").observe(3)
    return m, scraped(m)


def test_no_created_series():
    _, text = busy_worker()
    assert "_created" not in text
    assert "disagg_requests_total" in text and "disagg_phase_seconds_count" in text  # the page is not empty


def test_every_metric_name_carries_its_unit():
    _, text = busy_worker()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert types, text
    for name, kind in types.items():
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert name.endswith(UNITS), name


def test_the_prefix_caches_figures_are_named_like_the_rest_and_give_a_hit_rate():
    """Decode's prefix cache: hit tokens over the prompt tokens that looked it up (a hit rate
    in PromQL: rate(hit) / rate(queried)), bytes it saved, what it holds and evicted."""
    m = WorkerMetrics("decode")
    cache = PrefixCacheMetrics(m.registry, "decode")
    cache.answered({"prefix_tokens": 96, "reused_bytes": 4096}, prompt_tokens=120)
    cache.answered({"prefix_tokens": 0, "reused_bytes": 0}, prompt_tokens=80)
    cache.observe({"cached_tokens": 256, "unused_tokens": 256, "hit_tokens": 96, "evicted_tokens": 32})
    cache.observe({"cached_tokens": 192, "unused_tokens": 128, "hit_tokens": 96, "evicted_tokens": 64})
    text = scraped(m)
    types = {
        name: kind
        for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M)
        if name.startswith("disagg_prefix_cache")
    }
    assert types == {
        "disagg_prefix_cache_hit_tokens_total": "counter",
        "disagg_prefix_cache_queried_tokens_total": "counter",
        "disagg_prefix_cache_saved_bytes_total": "counter",
        "disagg_prefix_cache_evicted_tokens_total": "counter",
        "disagg_prefix_cache_tokens": "gauge",
    }
    for line in (
        'disagg_prefix_cache_hit_tokens_total{role="decode"} 96.0',
        'disagg_prefix_cache_queried_tokens_total{role="decode"} 200.0',
        'disagg_prefix_cache_saved_bytes_total{role="decode"} 4096.0',
        'disagg_prefix_cache_evicted_tokens_total{role="decode"} 64.0',
        'disagg_prefix_cache_tokens{role="decode"} 192.0',
    ):
        assert line in text, text


def test_pool_capacity_is_one_gauge_per_unit():
    _, text = busy_worker()
    assert not re.search(r"^disagg_pool_free[{ ]", text, re.M), "a gauge mixing tokens, rows and slots"
    allocators = {}
    for name, allocator in re.findall(r'^(disagg_pool_free_\w+)\{allocator="(\w+)",role="decode"\} ', text, re.M):
        allocators.setdefault(name, set()).add(allocator)
    assert allocators == {
        "disagg_pool_free_tokens": {"full", "swa"},
        "disagg_pool_free_slots": {"mamba"},
        "disagg_pool_free_rows": {"aux"},
    }
    assert 'disagg_pool_free_tokens{allocator="full",role="decode"} 4096.0' in text
    assert pool_free(text) == POOL  # what the leak checks compare, keyed as the pool names it


def test_a_pool_figure_without_a_unit_is_refused():
    m = WorkerMetrics("prefill")
    with pytest.raises(ValueError, match="must end in its unit"):
        m.observe_pool({"free": 3})


def test_inflight_requests_while_one_is_served():
    m = WorkerMetrics("router")
    seen = []
    m.count(lambda: seen.append(inflight(scraped(m))) or {}, lambda out: True)
    assert seen == [1.0] and inflight(scraped(m)) == 0.0
    assert 'disagg_inflight_requests{role="router"} 0.0' in scraped(m)


@pytest.mark.parametrize(
    "reason, label",
    [
        ("decode failed: TRANSFERRING deadline of 30 s passed", "decode:timeout"),
        ("prefill failed: layout mismatch: full: kv_heads", "prefill:layout"),
        ("decode gave a malformed answer: Expected `int`", "decode:malformed"),
        ("cancelled by the client", "cancelled"),
        ("no prefill/decode pair is up (pair 0: decode: unreachable at http://x:1)", "unreachable"),
        ("something nobody foresaw", "other"),
    ],
)
def test_a_failure_is_labelled_by_side_and_kind(reason, label):
    """Issue 36: failures were labelled by their first word only ("decode"), which says nothing."""
    from disagg.api.metrics import failure_label

    assert failure_label(reason) == label


def test_the_http_server_counts_every_answer_and_states_its_capacity():
    """Issue 36: the router's /metrics did not count 400s and had no capacity gauge."""
    import urllib.error
    import urllib.request

    from disagg.api.server import ApiServer, HttpLimits, Service
    from disagg.errors import BadRequest

    def refuse(body):
        raise BadRequest("no")

    m = WorkerMetrics("router")
    api = ApiServer(
        ("127.0.0.1", 0),
        Service({"/generate": refuse}, lambda: True, m.registry, metrics=m),
        HttpLimits(max_inflight=7),
    ).start()
    url = f"http://127.0.0.1:{api.port}"
    try:
        for path, data in (("/generate", b"{}"), ("/nowhere", None), ("/health", None)):
            try:
                urllib.request.urlopen(urllib.request.Request(url + path, data), timeout=10).read()
            except urllib.error.HTTPError:
                pass
        text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        head = urllib.request.urlopen(urllib.request.Request(url + "/metrics", method="HEAD"), timeout=10)
        assert head.status == 200 and head.read() == b""  # HEAD /metrics was a 501
    finally:
        api.stop()
    assert 'disagg_http_answers_total{role="router",route="/generate",status="400"} 1.0' in text
    assert 'disagg_http_answers_total{role="router",route="other",status="404"} 1.0' in text
    assert 'disagg_http_answers_total{role="router",route="/health",status="200"} 1.0' in text
    assert 'disagg_capacity_requests{role="router"} 7.0' in text and "disagg_http_connections_requests" in text


def test_the_routers_prefill_prediction_is_counted_beside_what_prefill_reported():
    """--route kv: the tokens the index predicted the chosen prefill would not compute, and what
    it reported, from answers that have both (a round-robin answer predicts nothing)."""
    m = WorkerMetrics("router")
    routing = PrefillRoutingMetrics(m.registry)
    routing.answered({"prefill_cached_predicted": 96, "prefill_cached_tokens": 96})
    routing.answered({"prefill_cached_predicted": 64, "prefill_cached_tokens": 32})
    routing.answered({"prefill_cached_tokens": 500})  # no prediction: not counted
    text = scraped(m)
    assert 'disagg_router_prefill_cached_tokens_total{source="predicted"} 160.0' in text, text
    assert 'disagg_router_prefill_cached_tokens_total{source="reported"} 128.0' in text, text
    assert re.search(r"^# TYPE disagg_router_prefill_cached_tokens_total counter$", text, re.M)
