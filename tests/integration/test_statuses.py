"""Every status the router's /generate answers with (README's HTTP API section and
docs/contract.md list them), each produced the way it happens in service, through the real
router process and, where the status comes from a worker, real prefill and decode processes
(stand-in engine, Mooncake on loopback); failures made with --inject-faults.

    200 served                       400 bad body; a prompt decode's pool can never hold
    409 aborted by request_id        499 the client hung up (answered to nobody: /metrics)
    500 decode.flip: verify fails;   502 decode.alloc: a worker failed the request
        prefill.flip: the check fails
    503 router full; decode's pool full; a pair that cannot be reached
    504 a TransferDone lost (control.drop_done): decode's transfer deadline passes
    404, 405, 413 the HTTP layer's own (408: tests/faults/test_hostile_http.py)
"""

import http.client
import json
import re
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.api import metrics
from disagg.tools.launcher import Launcher

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
COMMON = ["--preset", "tiny-hybrid", "--device", "cpu", "--max-requests", "8"]
DECODE_TOKENS = 10000  # decode: two long generations fit, a 12000-token prompt never does
LONG = {"prompt_len": 100, "max_new_tokens": 4096}  # tens of seconds of generation on decode
WALKED = (200, 400, 409, 499, 500, 502, 503, 504)


def call(url: str, body: dict | bytes, method: str = "POST") -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data if method == "POST" else None, {"Content-Type": "application/json"}, method=method
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def scrape(http: str) -> str:
    with urllib.request.urlopen(http + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def failures(http: str, reason: str) -> float:
    return sum(
        s.value
        for f in text_string_to_metric_families(scrape(http))
        if f.name == "disagg_failures"
        for s in f.samples
        if s.name == "disagg_failures_total" and s.labels["reason"] == reason
    )


class InFlight:
    """A /generate held open on its own connection, answered on a thread."""

    def __init__(self, router: str, body: dict):
        url = urllib.parse.urlsplit(router)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
        self.conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        self.result: dict = {}
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            resp = self.conn.getresponse()
            self.result.update(status=resp.status, body=json.loads(resp.read()))
        except OSError as exc:
            self.result.update(status=None, error=str(exc))
        finally:
            self.conn.close()

    def hang_up(self) -> None:
        self.conn.sock.shutdown(socket.SHUT_RDWR)


@pytest.fixture(scope="module")
def launcher():
    with Launcher() as launcher:
        yield launcher


@pytest.fixture(scope="module")
def prefill(launcher):
    return launcher.start("prefill", *COMMON, "--max-tokens", "32768", "--bootstrap-bind", "tcp://127.0.0.1:*")


def _pair(launcher, prefill: dict, *decode_flags: str, router_flags: tuple[str, ...] = ()) -> dict:
    decode = launcher.start("decode", *COMMON, "--bootstrap-addr", prefill["bootstrap"], *decode_flags)
    router = launcher.start(
        "router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}", *router_flags
    )
    return {"prefill": prefill["http"], "decode": decode["http"], "router": router["http"]}


@pytest.fixture(scope="module")
def clean(launcher, prefill):
    stack = _pair(
        launcher,
        prefill,
        "--max-tokens",
        str(DECODE_TOKENS),
        "--queue-wait",
        "0.5",
        router_flags=("--max-inflight", "2"),
    )
    stack["initial"] = metrics.pool_free(scrape(stack["decode"]))
    return stack


def _back(stack: dict) -> bool:
    """Decode holds nothing any more and serves nothing."""
    text = scrape(stack["decode"])
    return metrics.pool_free(text) == stack["initial"] and metrics.inflight(text) == 0


def test_200_served(clean):
    status, body, _ = call(clean["router"] + "/generate", {"prompt_len": 64, "max_new_tokens": 4})
    assert status == 200 and body["ok"] and body["verified"] and len(body["output_tokens"]) == 4, body


@pytest.mark.parametrize(
    "request_body,says",
    [
        ({"prompt_len": 0}, "prompt_len must be an int"),
        ({"prompt_len": 12000}, "does not fit in this pool: the full pages hold"),  # decode's refusal, naming the part
    ],
)
def test_400_for_what_the_caller_must_change(clean, request_body, says):
    status, body, _ = call(clean["router"] + "/generate", request_body)
    assert status == 400 and says in body["error"], body


def test_503_409_499_while_generations_run(clean, eventually):
    """Router full, decode's pool full (both 503 with Retry-After, at once); an abort by
    request_id (409) and a client that hangs up (499, counted on the router's /metrics)."""
    router = clean["router"]
    first = InFlight(router, {**LONG, "request_id": "long-1"})
    eventually(
        lambda: metrics.inflight(scrape(clean["decode"])) == 1 and metrics.inflight(scrape(clean["prefill"])) == 0,
        30,
        "decode is generating the first long request",
    )
    status, body, headers = call(router + "/generate", {"prompt_len": 9950})
    assert status == 503 and "pool full" in body["error"] and headers["Retry-After"] == "1", body
    second = InFlight(router, {**LONG, "request_id": "long-2"})
    eventually(lambda: metrics.inflight(scrape(clean["decode"])) == 2, 30, "both long requests on decode")
    status, body, headers = call(router + "/generate", {"prompt_len": 8})
    assert status == 503 and "2 requests in flight" in body["error"] and headers["Retry-After"] == "1", body

    assert call(router + "/abort", {"request_id": "long-1"})[1] == {"request_id": "long-1", "aborted": True}
    first.thread.join(30)
    assert first.result["status"] == 409 and first.result["body"]["reason"] == "cancelled by the client"
    assert first.result["body"]["status"] == 409 and first.result["body"]["ok"] is False

    cancelled = failures(router, "cancelled")
    second.hang_up()
    eventually(lambda: failures(router, "cancelled") == cancelled + 1, 30, "the router counted the hang-up")
    second.thread.join(30)
    eventually(lambda: _back(clean), 10, "both generations stopped, their pages back")


@pytest.fixture(scope="module")
def flipped(launcher, prefill):
    return _pair(launcher, prefill, "--max-tokens", "4096", "--inject-faults", "decode.flip=1")


def test_500_when_decode_finds_the_kv_wrong(flipped):
    status, body, _ = call(flipped["router"] + "/generate", {"prompt_len": 64, "max_new_tokens": 2})
    assert status == 500 and body["status"] == 500 and not body["ok"] and not body["verified"], body
    assert body["reason"].startswith("verify: ") and "differs" in body["reason"], body
    assert failures(flipped["decode"], "verify") == 1 and failures(flipped["router"], "verify") == 1


@pytest.fixture(scope="module")
def failing(launcher, prefill):
    return _pair(launcher, prefill, "--max-tokens", "4096", "--inject-faults", "decode.alloc=1")


def test_502_when_a_worker_failed_the_request(failing):
    status, body, _ = call(failing["router"] + "/generate", {"prompt_len": 64})
    assert status == 502 and body["status"] == 502 and "injected fault at decode.alloc" in body["reason"], body


@pytest.fixture(scope="module")
def late(launcher):
    prefill = launcher.start(
        "prefill",
        *COMMON,
        "--max-tokens",
        "4096",
        "--bootstrap-bind",
        "tcp://127.0.0.1:*",
        "--inject-faults",
        "control.drop_done=1",
    )
    return _pair(launcher, prefill, "--max-tokens", "4096", "--transfer-timeout", "1")


def test_504_when_a_deadline_passed(late):
    status, body, _ = call(late["router"] + "/generate", {"prompt_len": 64})
    assert status == 504 and body["status"] == 504 and "deadline" in body["reason"], body


def test_503_when_a_worker_cannot_be_reached(launcher, prefill):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"http://127.0.0.1:{s.getsockname()[1]}"
    router = launcher.start("router", "--pair", f"{prefill['http']},{gone},{prefill['bootstrap']}")["http"]
    status, body, headers = call(router + "/generate", {"prompt_len": 8})
    assert status == 503 and body["room"] is None and gone in body["reason"] and headers["Retry-After"] == "1", body


def test_the_http_layers_own_statuses(clean):
    assert call(clean["router"] + "/nowhere", {})[0] == 404
    assert call(clean["router"] + "/generate", {}, method="GET")[0] == 405
    url = urllib.parse.urlsplit(clean["router"])
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:  # the length is refused before a byte of the body is read
        conn.putrequest("POST", "/generate")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(17 << 20))
        conn.endheaders()
        assert conn.getresponse().status == 413
    finally:
        conn.close()


def test_the_docs_list_every_status():
    readme = ROOT.joinpath("README.md").read_text()
    api = readme[readme.index("## The HTTP API") :]
    api = api[: api.index("\n## ", 5)]
    contract = ROOT.joinpath("docs", "contract.md").read_text()
    for status in (*WALKED, 404, 405, 408, 413):
        assert re.search(rf"\b{status}\b", api), f"README's HTTP API section does not list {status}"
        assert re.search(rf"\b{status}\b", contract), f"docs/contract.md does not list {status}"


MODEL = ("--preset", "tiny-model-qwen3-next", "--engine", "model", "--device", "cpu")
MODEL += ("--max-tokens", "1024", "--max-requests", "4")


def _flipping_prefill(launcher) -> dict:
    """A model-engine prefill that flips one byte of every prompt's KV it computed, sent whole
    (streamed, a layer may leave before the flip: then decode never sees it, and the check
    rightly passes)."""
    flags = ("--bootstrap-bind", "tcp://127.0.0.1:*", "--inject-faults", "prefill.flip=1", "--stream-layers", "off")
    return launcher.start("prefill", *MODEL, *flags)


@pytest.fixture(scope="module")
def checked(launcher):
    """A real model (tiny qwen3-next: its linear-attention state is read by every step) whose
    prefill flips one byte of every prompt's KV before it digests and sends it (a wrong
    computation, which the bytes' digest cannot tell), and whose decode compares every
    generation with a colocated run."""
    prefill = _flipping_prefill(launcher)
    decode = launcher.start("decode", *MODEL, "--bootstrap-addr", prefill["bootstrap"], "--check-rate", "1")
    router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
    return {"prefill": prefill["http"], "decode": decode["http"], "router": router["http"]}


def test_500_when_the_colocated_check_differs(checked):
    """The KV arrived as prefill wrote it, so verification passes; the colocated check sees
    the generation differ, and that fails the request."""
    status, body, _ = call(checked["router"] + "/generate", {"prompt_len": 12, "max_new_tokens": 4})
    assert status == 500 and body["status"] == 500 and not body["ok"], body
    assert body["reason"].startswith("check: the generation differs from the colocated run"), body
    assert body["check"]["logits_match"] is False and len(body["output_tokens"]) == 4, body
    assert failures(checked["decode"], "check") == 1 and failures(checked["router"], "check") == 1


@pytest.fixture(scope="module")
def tp_checked(launcher):
    """A decode instance of TP size 2 behind a prefill of TP size 1 (model engine, every
    generation checked on every rank); prefill flips the last byte of the state it computed,
    which is in decode rank 1's units (the last state heads)."""
    prefill = _flipping_prefill(launcher)
    ranks = [
        launcher.start(
            "decode",
            *MODEL,
            "--bootstrap-addr",
            prefill["bootstrap"],
            "--check-rate",
            "1",
            "--tp-size",
            "2",
            "--tp-rank",
            str(rank),
        )
        for rank in range(2)
    ]
    decode = "+".join(r["http"] for r in ranks)
    router = launcher.start("router", "--pair", f"{prefill['http']},{decode},{prefill['bootstrap']}")
    return {"router": router["http"]}


def test_500_names_the_decode_rank_whose_check_differs_and_reports_every_ranks(tp_checked):
    status, body, _ = call(tp_checked["router"] + "/generate", {"prompt_len": 12, "max_new_tokens": 4})
    assert status == 500 and not body["ok"], body
    assert body["reason"].startswith("check: ") and body["reason"].endswith("(decode rank 1)"), body
    check = body["check"]
    assert check["failed_ranks"] == [1] and check["rank"] == 1 and check["ranks_checked"] == 2, check
    rank0, rank1 = check["per_rank"]
    assert rank0["token_match"] and rank0["logits_match"] and not rank1["logits_match"], check
    assert check["logits_match"] is False, "the instance's check is the failed rank's"


def _generating(stack: dict, tokens: int) -> bool:
    """Decode holds more than `tokens` tokens' pages beyond a LONG prompt's: it is generating."""
    free = metrics.pool_free(scrape(stack["decode"]))["full_tokens"]
    return free < stack["initial"]["full_tokens"] - LONG["prompt_len"] - tokens


@pytest.mark.parametrize("how", ["abort", "hang-up"])
def test_an_abort_during_generation_stops_it_and_frees_its_pages_at_once(clean, eventually, how):
    """Issue 35, item 4: an abort (or the client hanging up) once decode generates stops the
    generation at its next step; the pages come back at once, not when 4096 tokens are done."""
    eventually(lambda: _back(clean), 120, "decode idle before the test")
    long = InFlight(clean["router"], {**LONG, "request_id": "gen"})
    eventually(lambda: _generating(clean, 64), 60, "decode is generating")
    if how == "abort":
        assert call(clean["router"] + "/abort", {"request_id": "gen"})[1]["aborted"] is True
    else:
        long.hang_up()
    eventually(lambda: _back(clean), 5, "decode stopped generating and freed its pages")
    long.thread.join(30)
    if how == "abort":
        assert long.result["status"] == 409, long.result
    status, body, _ = call(clean["router"] + "/generate", {"prompt_len": 64, "max_new_tokens": 8})
    assert status == 200 and body["ok"], body


@pytest.fixture(scope="module")
def small(launcher, prefill):
    """Decode's pool holds 256 tokens (64 pages of 4): two requests growing to 99 tokens fit at
    once, a third waits for one to end."""
    return _pair(launcher, prefill, "--max-tokens", "256", "--queue-wait", "5")


def test_a_generation_is_admitted_with_all_the_pages_it_will_need(small):
    """Issue 35, item 12: admission reserved only the prompt's pages, so requests that each fit
    alone failed mid-generation with OutOfSpace (502) after prefill and transfer."""
    body = {"prompt_len": 60, "max_new_tokens": 40}
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda seed: call(small["router"] + "/generate", {**body, "seed": seed}), range(8)))
    assert [status for status, _, _ in results] == [200] * 8, [b.get("reason") for _, b, _ in results]
    assert all(len(b["output_tokens"]) == 40 for _, b, _ in results)


def test_a_generation_that_could_never_fit_is_refused_before_anything_moves(small):
    status, body, _ = call(small["router"] + "/generate", {"prompt_len": 60, "max_new_tokens": 4096})
    assert status == 400 and "60 tokens growing to 4155 does not fit in this pool: the full pages hold" in body["error"]


def test_503_when_what_a_generation_will_need_is_promised_to_another(clean, eventually):
    """A 4096-token generation holds its reservation from the start: a prompt that fits in what
    is free now but not beside that reservation waits --queue-wait, then 503."""
    eventually(lambda: _back(clean), 120, "decode idle before the test")
    long = InFlight(clean["router"], {**LONG, "request_id": "reserving"})
    eventually(
        lambda: metrics.inflight(scrape(clean["decode"])) == 1 and metrics.inflight(scrape(clean["prefill"])) == 0,
        60,
        "decode is generating",
    )
    status, body, _ = call(clean["router"] + "/generate", {"prompt_len": DECODE_TOKENS - 4000})
    assert status == 503 and "pool full" in body["error"], body
    call(clean["router"] + "/abort", {"request_id": "reserving"})
    long.thread.join(30)
    eventually(lambda: _back(clean), 10, "decode idle again")
