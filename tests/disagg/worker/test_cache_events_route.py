"""POST /cache/events of decode and of prefill, one route (issue 39, KV-aware routing): changes
since the caller's seq when it names our epoch, the whole contents when it names another (we
restarted: our seq counts another journal) or none; a malformed `since` is a 400 that changes
nothing; no route without a cache. Served by the real ApiServer over HTTP, on a real pool and
prefix cache (prefill's as prefill makes it: SWA pages for every position, aligned hits)."""

import json
import types
import urllib.error
import urllib.request

import numpy as np
import pytest

from disagg.api.server import ApiServer
from disagg.control.cache_events import decode_events
from disagg.decode.routes import DecodeRoutes
from disagg.prefill.routes import PrefillRoutes
from kvpool import HybridPool, PoolConfig, get_preset
from kvpool.cache.prefix import PrefixCache


def post(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url + "/cache/events", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


ROLES = {"decode": DecodeRoutes, "prefill": PrefillRoutes}


def serve(cache: "PrefixCache | None", epoch: int = 77, role: str = "decode") -> ApiServer:
    server = types.SimpleNamespace(
        cache=cache,
        epoch=epoch,
        ready=True,
        readiness=lambda: True,
        health=lambda: {"status": "ok"},
        abort=lambda room, reason: {},
        available=lambda: {},
    )
    return ApiServer(("127.0.0.1", 0), ROLES[role](server).service()).start()


def keep(cache: PrefixCache, prompt: np.ndarray) -> None:
    kv, hit = cache.admit(prompt, grow_to=len(prompt))
    cache.release(kv, hit, prompt)


@pytest.fixture(params=sorted(ROLES))
def role(request) -> str:
    return request.param


@pytest.fixture
def cache(role) -> PrefixCache:
    pool = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=4, device="cpu"))
    return PrefixCache(pool) if role == "decode" else PrefixCache(pool, window_only=False, align=8)


def test_changes_since_our_epoch_and_everything_for_another(cache, role):
    api = serve(cache, role=role)
    url = f"http://127.0.0.1:{api.port}"
    try:
        keep(cache, np.arange(16))
        first = decode_events(post(url, {"since": None})[1])
        assert first.reset and first.epoch == 77 and len(first.added) == 4 and first.seq == 1
        assert first.align == (8 if role == "prefill" else 4)  # prefill resumes only at its passes
        keep(cache, np.arange(24))
        delta = decode_events(post(url, {"since": 1, "epoch": 77})[1])
        assert not delta.reset and len(delta.added) == 2 and delta.seq == 2
        restarted = decode_events(post(url, {"since": 1, "epoch": 76})[1])  # a reader of another process
        assert restarted.reset and len(restarted.added) == 6
        for bad in ({"since": -1}, {"since": "1"}, {"since": 1.5}, {"since": True}):
            status, raw = post(url, bad)
            assert status == 400 and b"since must be" in raw, raw
        assert decode_events(post(url, {"since": 2, "epoch": 77})[1]).added == []  # nothing changed meanwhile
    finally:
        api.stop()


def test_no_cache_no_route(role):
    api = serve(None, role=role)
    try:
        assert post(f"http://127.0.0.1:{api.port}", {"since": None})[0] == 404
    finally:
        api.stop()
