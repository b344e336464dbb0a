"""What a router believes of its workers' load (issue 39): every worker rank's /health says the
requests and prompt tokens it holds, queued and running (disagg/control/load.py), and the
router weighs its own requests there with what that report holds of other routers'
(disagg/router/load.py). So a pair kept busy by another router is passed over, a burst this router sent since the last
report still counts, a report that does not parse leaves that worker unknown (never a crash)
and a number past its cap is read as the cap; the router's /metrics show what it believes of
each worker. Real HTTP servers stand in for the workers; the routers are real."""

import logging
import threading
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from disagg.api.server import ApiServer, Service
from disagg.control.load import MAX_REQUESTS, MAX_TOKENS, LoadError, WorkerLoad, encode_load, read_load
from disagg.router.load import LoadBook
from disagg.router.router import Pair, Router, RouterConfig
from disagg.router.routes import RouterRoutes

IDLE = encode_load(WorkerLoad(0, 0, 0, 0))


def busy(tokens: int, requests: int = 1) -> dict:
    """A /health `load` with `requests` running, `tokens` prompt tokens in all."""
    return encode_load(WorkerLoad(queued_requests=0, queued_tokens=0, running_requests=requests, running_tokens=tokens))


class Worker:
    """A worker's HTTP face: /ready, /health (`health` may be changed while it runs), and its
    route answering SUCCESS (decode once `go` is set)."""

    def __init__(self, role: str):
        self.health = {"status": "ok", "bootstraps": ["main"], "load": IDLE}
        self.bodies: list[dict] = []
        self.go = threading.Event()
        self.go.set()
        route = self._prefill if role == "prefill" else self._decode
        self.api = ApiServer(
            ("127.0.0.1", 0),
            Service({f"/{role}": route}, lambda: True, CollectorRegistry(), health=lambda: self.health),
        ).start()
        self.url = f"http://127.0.0.1:{self.api.port}"

    def _prefill(self, body: dict) -> dict:
        return {"state": "SUCCESS", "first_token": 1}

    def _decode(self, body: dict) -> dict:
        self.bodies.append(body)
        self.go.wait(30)
        return {"state": "SUCCESS", "verified": True, "output_tokens": [1], "bytes": 0}


@pytest.fixture
def pairs():
    made: list[Worker] = []

    def make(n: int) -> list[tuple[Worker, Worker]]:
        out = [(Worker("prefill"), Worker("decode")) for _ in range(n)]
        made.extend(w for p in out for w in p)
        return out

    yield make
    for w in made:
        w.go.set()
        w.api.stop()


def router_of(workers: list[tuple[Worker, Worker]], **config) -> Router:
    """A router over these pairs that probes only when told (its first look is at start)."""
    return Router(RouterConfig(tuple(Pair(p.url, d.url, "main") for p, d in workers), probe_every_s=3600, **config))


# ---- the report, read as untrusted --------------------------------------------------------
def test_a_report_is_read_typed_with_every_number_capped():
    assert read_load(busy(300, 2)) == WorkerLoad(0, 0, 2, 300)
    assert read_load(busy(300, 2)).tokens == 300
    huge = {"queued_requests": 10**30, "queued_tokens": 10**30, "running_requests": 1, "running_tokens": 1 << 62}
    assert read_load(huge) == WorkerLoad(MAX_REQUESTS, MAX_TOKENS, 1, MAX_TOKENS)


@pytest.mark.parametrize(
    "bad",
    [
        "busy",
        [1, 2, 3, 4],
        None,
        {"queued_requests": 0, "queued_tokens": 0, "running_requests": 1},  # a field missing
        {**busy(300), "running_tokens": -1},
        {**busy(300), "running_tokens": 1.5},
        {**busy(300), "running_requests": True},
        {**busy(300), "running_tokens": "300"},
        {**busy(300), "running_requests": 0},  # tokens without a request
        {**busy(300), "type": "CacheEvents"},
    ],
)
def test_a_malformed_report_is_refused_with_the_reason(bad):
    with pytest.raises(LoadError, match="malformed load"):
        read_load(bad)


# ---- the book: the larger of the report and our own ---------------------------------------
def test_the_router_adds_its_own_requests_to_what_a_report_holds_of_others():
    book, url = LoadBook(), "http://w:1"
    book.report(url, {"load": busy(300)})  # another router's
    assert book.tokens([url]) == 300
    book.sent([url], 200)  # a burst of ours since the report, which cannot show it yet
    book.sent([url], 500)
    assert book.tokens([url]) == 1000
    book.report(url, {"load": busy(1000, 3)})  # the next round holds ours too: never counted twice
    assert book.tokens([url]) == 1000
    book.sent([url], -200)  # ours answered: gone at once, not at the next round
    assert book.tokens([url]) == 800
    book.report(url, {"load": busy(500)})  # ours, and the other router's request ended
    assert book.tokens([url]) == 500
    book.sent([url], -500)
    assert book.tokens([url]) == 0
    book.report(url, {"load": busy(200)})  # another router's again
    book.sent([url], 200)
    assert book.tokens([url]) == 400
    book.report(url, {"load": busy(200)})  # the other's ended and ours arrived: the report is all ours
    assert book.tokens([url]) == 200 and book.ranks() == {url: 200}


def test_a_report_holds_of_ours_at_most_all_we_had_there_while_it_was_asked():
    """The monitor asks, then reads: ours that ended or began meanwhile may be in the report
    or not; taken as in it, none is counted twice nor left counted once it ended."""
    book, url = LoadBook(), "http://w:1"
    book.sent([url], 200)
    book.asking([url])
    book.sent([url], -200)  # answered while the report was on its way, which still holds it
    book.sent([url], 50)  # and one sent meanwhile, which it holds too
    book.report(url, {"load": busy(250, 2)})
    assert book.tokens([url]) == 50
    book.sent([url], -50)
    assert book.tokens([url]) == 0


def test_an_instance_is_as_busy_as_its_busiest_rank():
    book = LoadBook()
    book.report("http://r0:1", {"load": busy(100)})
    book.report("http://r1:1", {"load": busy(400)})
    book.sent(["http://r0:1", "http://r1:1"], 250)
    assert book.tokens(["http://r0:1", "http://r1:1"]) == 650
    assert book.ranks() == {"http://r0:1": 350, "http://r1:1": 650}
    book.forget(["http://r1:1"])  # no pair names it any more; our request there still counts
    assert book.ranks() == {"http://r0:1": 350, "http://r1:1": 250}


def test_a_worker_whose_report_does_not_parse_is_unknown_and_logged_once(caplog):
    book, url = LoadBook(), "http://w:1"
    book.sent([url], 64)
    with caplog.at_level(logging.WARNING, "disagg.router.load"):
        book.report(url, {"load": busy(5000)})
        for _ in range(3):
            book.report(url, {"load": {"running_tokens": "lots"}})
        assert book.reported(url) is None and book.tokens([url]) == 64  # ours still counts
        book.report(url, {})  # an older worker (no `load`), or one that did not answer: quietly unknown
        book.report(url, {"load": busy(10)})
        book.report(url, {"load": "lots"})
    warned = [r.getMessage() for r in caplog.records if r.name == "disagg.router.load"]
    assert len(warned) == 2 and all(url in w and "malformed load" in w for w in warned), warned


# ---- the router over HTTP -----------------------------------------------------------------
def test_a_pair_its_workers_report_busy_is_passed_over_and_used_once_idle(pairs):
    """Nothing cached, nothing of this router in flight: what pair 0's decode says it holds
    (another router's requests) sends every request to pair 1, until it says it is idle."""
    (p0, d0), (p1, d1) = workers = pairs(2)
    d0.health["load"] = busy(4096, 2)
    router = router_of(workers)
    try:
        assert [router.generate({"prompt_len": 8})["pair"] for _ in range(3)] == [1, 1, 1]
        d0.health["load"] = IDLE
        router.monitor.probe_all()
        assert sorted(router.generate({"prompt_len": 8})["pair"] for _ in range(2)) == [0, 1]
    finally:
        router.close()


def test_a_prefill_reporting_a_queue_is_passed_over(pairs):
    (p0, d0), (p1, d1) = workers = pairs(2)
    p1.health["load"] = encode_load(WorkerLoad(3, 900, 1, 300))
    router = router_of(workers)
    try:
        assert [router.generate({"prompt_len": 8})["pair"] for _ in range(3)] == [0, 0, 0]
    finally:
        router.close()


@pytest.mark.parametrize("load", ["busy", {"running_tokens": -1}, [4096], {**busy(4096), "running_requests": 0}])
def test_a_worker_that_lies_about_its_load_is_served_as_unknown(pairs, load):
    (p0, d0), (p1, d1) = workers = pairs(2)
    d0.health["load"] = load
    router = router_of(workers)
    try:
        outs = [router.generate({"prompt_len": 8}) for _ in range(2)]
        assert all(o["ok"] for o in outs) and sorted(o["pair"] for o in outs) == [0, 1], outs
        assert router.load.reported(d0.url) is None and router.load.reported(d1.url) == read_load(IDLE)
    finally:
        router.close()


def test_a_worker_reporting_past_the_cap_is_read_at_the_cap(pairs):
    (p0, d0), (p1, d1) = workers = pairs(2)
    d0.health["load"] = busy(10**40, 10**40)
    router = router_of(workers)
    try:
        assert router.load.reported(d0.url) == WorkerLoad(0, 0, MAX_REQUESTS, MAX_TOKENS)
        assert router.generate({"prompt_len": 8})["pair"] == 1
    finally:
        router.close()


def gauge(api: ApiServer) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{api.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.labels["worker"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "disagg_router_worker_load_tokens"
        for s in f.samples
    }


def test_the_routers_metrics_show_what_it_believes_of_each_worker(pairs, eventually, tmp_path):
    """One series per worker: its report, or this router's own request there where more (a
    request held at pair 1's decode, sent since the last report); gone once no pair names it."""
    (p0, d0), (p1, d1) = pairs(2)
    d0.health["load"] = busy(4096, 2)
    path = tmp_path / "pairs"
    path.write_text(f"{p0.url},{d0.url},main\n{p1.url},{d1.url},main\n")
    router = Router(RouterConfig((), pairs_file=str(path), probe_every_s=3600))
    api = ApiServer(("127.0.0.1", 0), RouterRoutes(router).service()).start()
    d1.go.clear()
    held = threading.Thread(target=router.generate, args=({"prompt_len": 100},))
    try:
        assert gauge(api) == {p0.url: 0, d0.url: 4096, p1.url: 0, d1.url: 0}
        held.start()
        eventually(lambda: d1.bodies, 10, "the request is held at pair 1's decode")
        assert gauge(api) == {p0.url: 0, d0.url: 4096, p1.url: 100, d1.url: 100}
        d1.go.set()
        held.join(10)
        path.write_text(f"{p0.url},{d0.url},main\n")  # pair 1 leaves
        router.monitor.probe_all()
        assert gauge(api) == {p0.url: 0, d0.url: 4096}
    finally:
        d1.go.set()
        api.stop()
        router.close()
