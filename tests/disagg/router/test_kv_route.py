"""The router's choice over real HTTP (stand-in workers, a real Router): with --route kv a
request goes to the pair whose decode holds its prefix (learnt right after the previous turn
ended), round robin ignores it; pairs in --pairs-file join and leave at run time, a pair taken
out gets nothing and, put back, keeps its number and is used again; a file that does not parse
leaves the pairs as they were."""

import os
import threading
import time

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from disagg.api.server import ApiServer, Service
from disagg.router.router import Pair, Router, RouterConfig
from kvpool.cache.blocks import chain_keys

PAGE = 4


class Worker:
    """A worker's HTTP face: /ready, /health, its route (SUCCESS), and where it caches (decode
    by default) /cache/events answering every whole page of the prompts it served (a reset
    each time); a prefill that caches answers the prompt positions it held (prefix_tokens)."""

    def __init__(self, role: str, caches: "bool | None" = None, **health):
        self.bodies: list[dict] = []
        self.keys: set[int] = set()
        self.go = threading.Event()  # decode answers once set
        self.go.set()
        self.caches = role == "decode" if caches is None else caches
        routes = {f"/{role}": self._prefill if role == "prefill" else self._decode}
        if self.caches:
            routes["/cache/events"] = self._events
        health = {
            "status": "ok",
            "bootstraps": ["main"],
            "available": {"full_tokens": 1 << 20},
            **({"prefix_cache": {}} if self.caches else {}),
            **health,
        }
        self.api = ApiServer(
            ("127.0.0.1", 0), Service(routes, lambda: True, CollectorRegistry(), health=lambda: health)
        ).start()
        self.url = f"http://127.0.0.1:{self.api.port}"

    def _prefill(self, body: dict) -> dict:
        self.bodies.append(body)
        if not self.caches:
            return {"state": "SUCCESS", "first_token": 1}
        tokens = np.asarray(body["token_ids"])
        chain = chain_keys(tokens, PAGE)[: (len(tokens) - 1) // PAGE].view(np.int64).tolist()
        held = next((i for i, k in enumerate(chain) if k not in self.keys), len(chain))
        self.keys.update(chain_keys(tokens, PAGE).view(np.int64).tolist())
        return {"state": "SUCCESS", "first_token": 1, "prefix_tokens": held * PAGE}

    def _decode(self, body: dict) -> dict:
        self.bodies.append(body)
        self.go.wait(30)
        self.keys.update(chain_keys(np.asarray(body["token_ids"]), PAGE).view(np.int64).tolist())
        return {"state": "SUCCESS", "verified": True, "output_tokens": [1], "bytes": 0}

    def _events(self, body: dict) -> dict:
        return {
            "type": "CacheEvents",
            "epoch": 1,
            "seq": len(self.bodies),
            "page_size": PAGE,
            "reset": True,
            "added": sorted(self.keys),
            "evicted": [],
        }


@pytest.fixture
def stand_ins():
    made: list[Worker] = []

    def make(n: int) -> list[tuple[Worker, Worker]]:
        pairs = [(Worker("prefill"), Worker("decode")) for _ in range(n)]
        made.extend(w for p in pairs for w in p)
        return pairs

    yield make
    for w in made:
        w.api.stop()


def pair_of(p: Worker, d: Worker) -> Pair:
    return Pair(p.url, d.url, "main")


def conversation(router: Router, seed: int, turns: int) -> list[int]:
    """The pair each turn went to; every turn resends the conversation so far."""
    rng, prompt, went = np.random.default_rng(seed), [], []
    for _ in range(turns):
        prompt = prompt + rng.integers(0, 50000, 24).tolist()
        out = router.generate({"token_ids": prompt})
        assert out["ok"], out
        went.append(out["pair"])
        prompt = prompt + out["output_tokens"]
    return went


@pytest.mark.parametrize("route", ["kv", "round-robin"])
def test_a_conversation_stays_where_its_prefix_is(stand_ins, route):
    workers = stand_ins(2)
    router = Router(RouterConfig(tuple(pair_of(*w) for w in workers), route=route, probe_every_s=3600))
    try:
        went = [conversation(router, seed, 4) for seed in range(3)]
    finally:
        router.close()
    stayed = all(len(set(w)) == 1 for w in went)
    assert stayed == (route == "kv"), went
    assert {p for w in went for p in w} == {0, 1}  # both pairs serve: new conversations spread


@pytest.mark.parametrize("route", ["kv", "round-robin"])
def test_a_conversation_stays_on_the_prefill_that_cached_it(route):
    """Two prefills that cache, one decode that does not (two pairs): with --route kv each turn
    goes back to the prefill that computed the one before (read right after that turn ended),
    and the answer's prediction of what it will not compute is what it then reports; round
    robin alternates and predicts nothing."""
    prefills, decode = [Worker("prefill", caches=True) for _ in range(2)], Worker("decode", caches=False)
    router = Router(RouterConfig(tuple(pair_of(p, decode) for p in prefills), route=route, probe_every_s=3600))
    try:
        rng, prompt, outs = np.random.default_rng(7), [], []
        for _ in range(4):
            prompt = prompt + rng.integers(0, 50000, 24).tolist()
            outs.append(router.generate({"token_ids": prompt}))
            assert outs[-1]["ok"], outs[-1]
            prompt = prompt + outs[-1]["output_tokens"]
    finally:
        router.close()
        for w in (*prefills, decode):
            w.api.stop()
    went = [o["pair"] for o in outs]
    reported = [o["prefill_cached_tokens"] for o in outs]
    if route == "kv":
        assert len(set(went)) == 1, went
        assert reported == [0, 24, 48, 72], reported  # every earlier turn's whole pages
        assert [o["prefill_cached_predicted"] for o in outs] == reported
    else:
        assert went == [0, 1, 0, 1] and reported == [0, 0, 24, 48], (went, reported)
        assert all("prefill_cached_predicted" not in o for o in outs)


def test_a_pair_busy_with_a_long_prompt_is_passed_over(stand_ins):
    """Nothing cached anywhere: the requests in flight decide. While pair 0 holds a 512-token
    request, the next two go to pair 1, not one each (round robin)."""
    (p0, d0), (p1, d1) = workers = stand_ins(2)
    router = Router(RouterConfig(tuple(pair_of(*w) for w in workers), probe_every_s=3600))
    d0.go.clear()
    try:
        busy = threading.Thread(target=router.generate, args=({"prompt_len": 512},))
        busy.start()
        deadline = time.monotonic() + 10
        while not d0.bodies:  # the long request is at pair 0's decode (and in flight at the router)
            assert time.monotonic() < deadline, "the first request never reached pair 0"
            threading.Event().wait(0.01)
        assert [router.generate({"prompt_len": 8})["pair"] for _ in range(2)] == [1, 1]
    finally:
        d0.go.set()
        busy.join(10)
        router.close()


@pytest.mark.parametrize(
    "health",
    [{"available": [1]}, {"available": {"full_tokens": "x"}}, {"available": {"full_tokens": -5}}, {"prefix_cache": 3}],
)
def test_a_health_that_lies_about_its_pool_or_cache_is_ignored(health):
    """/health is untrusted too: what does not parse is not known (no free-page term, no cache)."""
    workers = [Worker("prefill"), Worker("decode", **health)]
    router = Router(RouterConfig((pair_of(*workers),), probe_every_s=3600))
    try:
        out = router.generate({"token_ids": list(range(40))})
        assert out["ok"], out
        assert router.cache.ranks() == ({} if "prefix_cache" in health else {workers[1].url: 10})
    finally:
        router.close()
        for w in workers:
            w.api.stop()


def write(path, pairs: list[Pair]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("# pairs\n" + "".join(f"{p}\n" for p in pairs))
    os.replace(tmp, path)  # as an orchestrator swaps a mounted file


def test_pairs_join_and_leave_through_the_pairs_file(stand_ins, tmp_path, caplog):
    (p0, d0), (p1, d1) = stand_ins(2)
    path = tmp_path / "pairs"
    write(path, [pair_of(p0, d0)])
    router = Router(RouterConfig((), pairs_file=str(path), route="round-robin", probe_every_s=3600))
    try:
        assert [router.generate({"prompt_len": 8})["pair"] for _ in range(2)] == [0, 0]
        write(path, [pair_of(p0, d0), pair_of(p1, d1)])  # a pair joins
        router.monitor.probe_all()
        assert {router.generate({"prompt_len": 8})["pair"] for _ in range(4)} == {0, 1}
        write(path, [pair_of(p1, d1)])  # pair 0 leaves
        router.monitor.probe_all()
        served = len(d0.bodies)
        assert [router.generate({"prompt_len": 8})["pair"] for _ in range(3)] == [1, 1, 1]
        assert len(d0.bodies) == served and [p["pair"] for p in router.ready()["pairs"]] == [1]
        path.write_text("http://nope\n")  # a bad edit: nothing changes
        router.monitor.probe_all()
        assert "--pairs-file" in caplog.text and [p["pair"] for p in router.ready()["pairs"]] == [1]
        write(path, [pair_of(p1, d1), pair_of(p0, d0)])  # back: its old number, used again
        router.monitor.probe_all()
        assert {router.generate({"prompt_len": 8})["pair"] for _ in range(4)} == {0, 1}
        assert len(d0.bodies) > served
        write(path, [])  # none: 503 with the reason
        router.monitor.probe_all()
        out = router.generate({"prompt_len": 8})
        assert out["status"] == 503 and "no pair configured" in out["reason"], out
        assert not router.ready()["ready"]
    finally:
        router.close()
