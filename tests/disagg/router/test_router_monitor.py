"""The router watches its pairs in the background (issue 36, items 3, 4, 5, 7): /ready answers
at once from what it last saw, a pair whose decode lacks the pair's bootstrap name is down with
that reason (a configuration error, never a client's 400), requests go around a pair that is
down, and prompt_len ids are drawn below the pair's own vocabulary. Real HTTP servers stand in
for the workers."""

import json
import threading
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from disagg.api.server import ApiServer, Service
from disagg.router.router import Pair, Router, RouterConfig


class Worker:
    """A worker's HTTP face: /ready, /health (with what the router reads) and its route,
    answering SUCCESS and recording the bodies it was sent."""

    def __init__(self, role: str, health: dict, ready=lambda: True):
        self.bodies: list[dict] = []
        route = {"prefill": self._prefill, "decode": self._decode}[role]
        self.api = ApiServer(
            ("127.0.0.1", 0),
            Service({f"/{role}": route}, ready, CollectorRegistry(), health=lambda: {"status": "ok", **health}),
        ).start()
        self.url = f"http://127.0.0.1:{self.api.port}"

    def _prefill(self, body: dict) -> dict:
        self.bodies.append(body)
        return {"state": "SUCCESS", "first_token": 1}

    def _decode(self, body: dict) -> dict:
        self.bodies.append(body)
        return {"state": "SUCCESS", "verified": True, "output_tokens": [1], "bytes": 0}


@pytest.fixture
def workers():
    made: list[Worker] = []

    def make(role: str, ready=lambda: True, **health) -> Worker:
        made.append(Worker(role, health, ready))
        return made[-1]

    yield make
    for w in made:
        w.api.stop()


def test_a_bootstrap_name_decode_lacks_puts_the_pair_down_with_the_reason(workers):
    prefill = workers("prefill")
    decode = workers("decode", bootstraps=["default", "tcp://127.0.0.1:8998"])
    router = Router(RouterConfig((Pair(prefill.url, decode.url, "main"),)))
    try:
        ready = router.ready()
        assert not ready["ready"] and "decode was not given the pair's bootstrap 'main'" in ready["pairs"][0]["why"][0]
        out = router.generate({"prompt_len": 8})  # before: 400, blamed on the client
        assert out["status"] == 503 and "not given the pair's bootstrap 'main'" in out["reason"], out
        assert decode.bodies == [] and prefill.bodies == []
    finally:
        router.close()


def test_requests_go_around_a_pair_that_is_down(workers):
    prefill, decode = workers("prefill"), workers("decode", bootstraps=["default", "main"])
    down = workers("decode", ready=lambda: {"ready": False, "why": "bootstrap unreachable"})
    router = Router(RouterConfig((Pair(prefill.url, down.url, "main"), Pair(prefill.url, decode.url, "main"))))
    try:
        outs = [router.generate({"prompt_len": 8}) for _ in range(4)]
        assert all(o["ok"] and o["pair"] == 1 for o in outs) and down.bodies == [] and len(decode.bodies) == 4
        assert router.ready()["pairs"][0]["why"] == ["decode: not ready (HTTP 503: bootstrap unreachable)"]
    finally:
        router.close()


def test_prompt_len_ids_stay_below_the_pairs_vocabulary(workers):
    prefill, decode = workers("prefill", vocab_size=512), workers("decode", vocab_size=512, bootstraps=["main"])
    router = Router(RouterConfig((Pair(prefill.url, decode.url, "main"),)))  # --vocab-size left at 50,000
    try:
        assert router.generate({"prompt_len": 2000, "seed": 3})["ok"]
    finally:
        router.close()
    assert max(decode.bodies[0]["token_ids"]) < 512 and len(set(decode.bodies[0]["token_ids"])) > 100


def test_different_vocabularies_on_the_two_sides_put_the_pair_down(workers):
    prefill, decode = workers("prefill", vocab_size=512), workers("decode", vocab_size=1024, bootstraps=["main"])
    router = Router(RouterConfig((Pair(prefill.url, decode.url, "main"),)))
    try:
        assert "different vocabularies ([512] vs [1024])" in router.ready()["pairs"][0]["why"][0]
    finally:
        router.close()


def test_ready_answers_at_once_while_a_worker_hangs(workers):
    """Item 4: the router waited exactly 1 s for each side's /ready, so a decode whose own
    /ready took 1.01 s was reported "unreachable (timed out)" and its reason lost."""
    release = threading.Event()
    prefill = workers("prefill")
    slow = workers(
        "decode", ready=lambda: release.wait(30) and {"ready": False, "why": "bootstrap down"}, bootstraps=["main"]
    )
    router = Router(RouterConfig((Pair(prefill.url, slow.url, "main"),), probe_every_s=0.2))
    api = ApiServer(("127.0.0.1", 0), Service({}, router.ready, CollectorRegistry())).start()
    try:
        t0 = time.monotonic()
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{api.port}/ready", timeout=10)
        except urllib.error.HTTPError as exc:
            body = json.loads(exc.read())
        assert time.monotonic() - t0 < 0.5 and body["ready"] is False  # the hung probe is not waited for
        release.set()
    finally:
        release.set()
        api.stop()
        router.close()


def test_a_worker_answer_over_the_bound_is_not_read_and_counts_as_none(workers):
    """A worker's /health is untrusted: one far larger than any real answer is cut at
    MAX_ANSWER_BYTES (the router never holds more) and counts as no answer."""
    from disagg.router.monitor import MAX_ANSWER_BYTES, fetch, probe

    big = workers("decode", padding="x" * (MAX_ANSWER_BYTES + 10))
    status, body = fetch(big.url + "/health", 10)
    assert status == 0 and body == {"error": f"answer over {MAX_ANSWER_BYTES} bytes"}, (status, body)
    assert probe(big.url, 10).health == {}
    small = workers("decode", padding="x" * 1000)
    assert fetch(small.url + "/health", 10)[1]["padding"] == "x" * 1000
