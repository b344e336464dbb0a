"""The router's /ready tells the truth: ready while one pair has both sides ready, and each
pair says why it is not; GET of a POST route is a 405; a refused or failed request is
logged at WARNING with its reason (real HTTP servers stand in for the workers)."""

import json
import logging
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from disagg.api.server import ApiServer, Service
from disagg.errors import BadRequest
from disagg.router.router import Pair, Router, RouterConfig


def _get(url: str) -> tuple[int, dict, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ready_names_the_pairs_that_are_down_and_why():
    workers = {
        flag: ApiServer(("127.0.0.1", 0), Service({}, lambda flag=flag: flag, CollectorRegistry())).start()
        for flag in (True, False)
    }
    up, not_ready = (f"http://127.0.0.1:{workers[f].port}" for f in (True, False))
    dead = f"http://127.0.0.1:{_closed_port()}"
    try:
        router = Router(RouterConfig((Pair(up, dead, "main"), Pair(up, not_ready, "main"))))
        api = ApiServer(
            ("127.0.0.1", 0), Service({"/generate": router.generate}, router.ready, CollectorRegistry())
        ).start()
        try:
            status, body, _ = _get(f"http://127.0.0.1:{api.port}/ready")
            assert (
                status == 503
                and body["ready"] is False
                and body["pairs_up"] == 0
                and "no prefill/decode" in body["why"]
            )
            assert "decode: unreachable at " + dead in body["pairs"][0]["why"][0]
            assert body["pairs"][1]["why"] == ["decode: not ready (HTTP 503)"]
            router.close()
            router = Router(RouterConfig((Pair(up, up, "main"), Pair(up, dead, "main"))))
            api.service.routes["/generate"] = router.generate
            object.__setattr__(api.service, "ready", router.ready)
            status, body, _ = _get(f"http://127.0.0.1:{api.port}/ready")
            assert status == 200 and body["pairs_up"] == 1 and [p["up"] for p in body["pairs"]] == [True, False]
            status, body, headers = _get(f"http://127.0.0.1:{api.port}/generate")
            assert status == 405 and headers["Allow"] == "POST" and "takes POST" in body["error"]
        finally:
            api.stop()
            router.close()
    finally:
        for w in workers.values():
            w.stop()


def test_refused_and_failed_requests_are_logged_at_warning(caplog):
    """A request to a pair known down is refused at once (503, Unavailable) with the down
    side's reason (issue 36, item 5: before, it was sent and failed after a deadline); a
    request a pair takes and fails is logged with its room and pair."""
    dead = f"http://127.0.0.1:{_closed_port()}"
    up = ApiServer(("127.0.0.1", 0), Service({}, lambda: True, CollectorRegistry())).start()
    url = f"http://127.0.0.1:{up.port}"
    router = Router(RouterConfig((Pair(dead, dead, "main"),)))
    flaky = Router(RouterConfig((Pair(url, url, "main"),)))  # up, but its routes are missing: the request fails
    try:
        with caplog.at_level(logging.WARNING, logger="disagg.router.router"):
            down = router.generate({"prompt_len": 4, "max_new_tokens": 1})
            with pytest.raises(BadRequest, match="prompt_len"):
                flaky.generate({"prompt_len": 0})
            out = flaky.generate({"prompt_len": 4, "max_new_tokens": 1})
    finally:
        router.close()
        flaky.close()
        up.stop()
    assert not out["ok"] and down["status"] == 503 and "prefill: unreachable at " + dead in down["reason"]
    down, refused, failed = caplog.records[-3:]
    assert down.getMessage().startswith("request refused (Unavailable)") and dead in down.getMessage()
    assert refused.getMessage().startswith("request refused (BadRequest)")
    assert f"room {out['room']}, pair 0" in failed.getMessage() and "404" in failed.getMessage()


def test_unknown_fields_are_refused_and_a_workers_refusal_is_not_nested_json():
    """Issue 36 minors: `/generate` ignored unknown fields (`max_new_token` gave 1 token
    silently); a worker's 400 reached the client as JSON inside a string."""

    def refuse(body):
        raise BadRequest("token id 600 is outside the model's vocabulary of 512")

    worker = ApiServer(
        ("127.0.0.1", 0), Service({"/prefill": refuse, "/decode": refuse}, lambda: True, CollectorRegistry())
    ).start()
    url = f"http://127.0.0.1:{worker.port}"
    router = Router(RouterConfig((Pair(url, url, "main"),)))
    try:
        with pytest.raises(BadRequest, match="unknown field.*'max_new_token'") as caught:
            router.generate({"prompt_len": 4, "max_new_token": 8})
        assert caught.value.param == "max_new_token"
        with pytest.raises(BadRequest) as caught:
            router.generate({"token_ids": [600]})
        said = str(caught.value)
        assert "HTTP 400: BadRequest: token id 600 is outside" in said and '{"' not in said, said
    finally:
        router.close()
        worker.stop()
