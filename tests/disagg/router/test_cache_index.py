"""The router's copy of a worker rank's cache (disagg/router/cache_index.py) over real HTTP: a
reset, then changes since its seq, give the keys the worker holds; how much of a prompt an
instance holds is what its every rank holds; and every malformed, oversized or inconsistent
answer is refused whole with one log line, changing nothing (the next poll asks for
everything)."""

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from disagg.router.cache_index import CacheIndex
from kvpool.cache.blocks import chain_keys


class FakeRank:
    """A worker's /cache/events answering whatever body it is given (bytes or a dict), and
    recording the `since` it was asked with."""

    def __init__(self):
        self.body: "bytes | dict" = b""
        self.status = 200
        self.asked: list = []
        rank = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                rank.asked.append(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["since"])
                raw = rank.body if isinstance(rank.body, bytes) else json.dumps(rank.body).encode()
                self.send_response(rank.status)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, **fields) -> None:
        self.body = {
            "type": "CacheEvents",
            "epoch": 7,
            "seq": 1,
            "page_size": 4,
            "reset": False,
            "added": [],
            "evicted": [],
            **fields,
        }


@pytest.fixture
def rank():
    r = FakeRank()
    yield r
    r.server.shutdown()
    r.server.server_close()


PROMPT = np.arange(100, 141)  # 41 tokens: 10 whole pages of 4, a hit capped at 40


def keys(n: int, page: int = 4) -> list[int]:
    return chain_keys(PROMPT, page)[:n].view(np.int64).tolist()  # (as published: int64 bits)


def test_a_reset_then_changes_give_what_the_rank_holds(rank):
    index = CacheIndex()
    rank.answer(reset=True, seq=3, added=keys(6))
    index.poll(rank.url)
    assert rank.asked == [None] and index.cached_tokens((rank.url,), PROMPT) == 24
    rank.answer(seq=5, added=keys(10)[6:], evicted=[])
    index.poll(rank.url)
    assert rank.asked[-1] == 3 and index.cached_tokens((rank.url,), PROMPT) == 40
    rank.answer(seq=6, evicted=keys(10)[8:])
    index.poll(rank.url)
    assert rank.asked[-1] == 5 and index.cached_tokens((rank.url,), PROMPT) == 32
    assert index.cached_tokens((rank.url,), PROMPT[:33]) == 32  # capped: (33 - 1) // 4 pages
    assert index.cached_tokens((rank.url,), PROMPT[:32]) == 28
    rank.status = 404  # no cache (any more): nothing held
    index.poll(rank.url)
    assert index.cached_tokens((rank.url,), PROMPT) == 0


def test_an_instance_holds_what_every_rank_holds():
    ranks = [FakeRank(), FakeRank()]
    try:
        index = CacheIndex()
        ranks[0].answer(reset=True, added=keys(9))
        ranks[1].answer(reset=True, page_size=8, added=keys(3, page=8))  # 24 tokens
        for r in ranks:
            index.poll(r.url)
        urls = tuple(r.url for r in ranks)
        assert index.cached_tokens(urls[:1], PROMPT) == 36 and index.cached_tokens(urls, PROMPT) == 24
        assert index.cached_tokens(urls + ("http://127.0.0.1:1",), PROMPT) == 0  # a rank not known: 0
    finally:
        for r in ranks:
            r.server.shutdown()
            r.server.server_close()


def test_a_prefill_that_resumes_at_its_passes_is_predicted_at_them(rank):
    """A prefill of the model engine takes a hit only at a multiple of its pass (align 8,
    pages of 4): the index predicts what it will take, not all it holds; and an instance is
    `indexed` only once every rank has answered (a 0 then is a prediction, not a blank)."""
    index = CacheIndex()
    assert not index.indexed((rank.url,))
    rank.answer(reset=True, added=keys(7), align=8)  # 28 tokens held
    index.poll(rank.url)
    assert index.indexed((rank.url,)) and not index.indexed((rank.url, "http://127.0.0.1:1"))
    assert index.cached_tokens((rank.url,), PROMPT) == 24
    assert index.cached_tokens((rank.url,), PROMPT[:9]) == 8  # capped at 2 pages first
    assert index.cached_tokens((rank.url,), PROMPT[:8]) == 0  # 1 page: under one pass
    rank.answer(seq=2, added=keys(10)[7:], align=8)
    index.poll(rank.url)
    assert index.cached_tokens((rank.url,), PROMPT) == 40


HOSTILE = {
    "not JSON": b"{not json",
    "a list": [1, 2],
    "another type": {"type": "Lookup", "epoch": 7, "seq": 9, "page_size": 4, "reset": False, "added": [1]},
    "a key below int64": {"seq": 9, "added": [-(1 << 63) - 1]},
    "a key above int64": {"seq": 9, "added": [1 << 63]},
    "a string key": {"seq": 9, "added": ["1"]},
    "page size 12": {"seq": 9, "page_size": 12},
    "page size 0": {"seq": 9, "page_size": 0},
    "a reset that evicts": {"seq": 9, "reset": True, "added": [1], "evicted": [2]},
    "another epoch, no reset": {"seq": 9, "epoch": 8, "added": [1]},
    "another page size, no reset": {"seq": 9, "page_size": 8, "added": [1]},
    "a seq before ours": {"seq": 2, "added": [1]},
    "too many keys": {"seq": 9, "added": list(range(11))},
    "a bool seq": {"seq": True},
    "align not a multiple of the page": {"seq": 9, "align": 6},
    "align 0": {"seq": 9, "align": 0},
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_answer_is_refused_whole_and_changes_nothing(rank, case, caplog):
    index = CacheIndex(max_keys=10)
    rank.answer(reset=True, seq=3, added=keys(5))
    index.poll(rank.url)
    before = index.ranks()
    hostile = HOSTILE[case]
    if isinstance(hostile, dict) and "type" not in hostile:
        rank.answer(**hostile)
    else:
        rank.body = hostile if isinstance(hostile, bytes) else json.dumps(hostile).encode()
    with caplog.at_level(logging.WARNING, logger="disagg.router.cache_index"):
        index.poll(rank.url)
        index.poll(rank.url)  # the same again: asked from scratch, logged once
    assert index.ranks() == before and index.cached_tokens((rank.url,), PROMPT) == 20
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and f"{rank.url}/cache/events refused (nothing changed)" in lines[0], lines
    assert rank.asked[-1] is None  # after a refusal: everything, next time
    rank.answer(reset=True, seq=12, added=keys(7))  # a good answer is taken again
    index.poll(rank.url)
    assert index.cached_tokens((rank.url,), PROMPT) == 28
