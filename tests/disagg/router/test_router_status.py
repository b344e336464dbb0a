"""The router's /generate answers with a status a client and a load balancer understand, and
keeps its JSON body (ok, reason, room, timings): 503 when a worker cannot be reached, 504 when
a deadline passed, 502 for any other failure a worker reports (a layout mismatch), 500 when
both sides succeeded but decode's verification did not. Real router process; real HTTP
servers stand in for the workers."""

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from disagg.api.server import ApiServer, Service
from disagg.router.router import post_json
from harness.processes import reap, spawn

OK_PREFILL = {"state": "SUCCESS", "prefill_ms": 1.0, "transfer_ms": 0.5, "first_token": 3}
OK_DECODE = {
    "state": "SUCCESS",
    "verified": True,
    "output_tokens": [3],
    "bytes": 64,
    "mode": "direct",
    "transport": "mooncake",
}


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def workers():
    """start(prefill_answer, decode_answer) -> (prefill_url, decode_url); None: unreachable."""
    servers = []

    def start(answer: dict | None) -> str:
        if answer is None:
            return f"http://127.0.0.1:{_closed_port()}"
        routes = {"/prefill": lambda body: answer, "/decode": lambda body: answer, "/abort": lambda body: {}}
        servers.append(ApiServer(("127.0.0.1", 0), Service(routes, lambda: True, CollectorRegistry())).start())
        return f"http://127.0.0.1:{servers[-1].port}"

    yield start
    for s in servers:
        s.stop()


def _router(prefill: str, decode: str) -> tuple[subprocess.Popen, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISAGG_")}
    proc = spawn(
        [sys.executable, "-m", "disagg", "router", "--pair", f"{prefill},{decode},main"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        return proc, json.loads(proc.stdout.readline())["http"]
    except BaseException:
        reap(proc)
        raise


@pytest.mark.parametrize(
    "prefill,decode,status,says",
    [
        (OK_PREFILL, None, 503, "http://127.0.0.1:"),
        (
            {"state": "FAILED", "reason": "aborted by decode"},
            {"state": "FAILED", "reason": "decode: TRANSFERRING deadline of 30 s passed"},
            504,
            "deadline of 30 s",
        ),
        (
            {"state": "FAILED", "reason": "aborted by decode"},
            {"state": "FAILED", "reason": "layout mismatch: full: kv_heads x head_dim prefill 8 x 64, decode 12 x 64"},
            502,
            "layout mismatch",
        ),
        (OK_PREFILL, {**OK_DECODE, "verified": False}, 500, ""),
        (OK_PREFILL, OK_DECODE, 200, ""),
    ],
)
def test_a_failed_request_has_a_service_status_and_keeps_its_body(workers, prefill, decode, status, says):
    proc, router = _router(workers(prefill), workers(decode))
    try:
        req = urllib.request.Request(router + "/generate", b'{"prompt_len": 8}', {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                code, body = resp.status, json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            code, body = exc.code, json.loads(exc.read())
        assert code == status and body["ok"] is (status == 200) and body["status"] == status, body
        assert says in body["reason"] and "timings_ms" in body
        # a pair the router knows is down (unreachable) gets no room: nothing was sent to it
        assert body["room"] is None if status == 503 else isinstance(body["room"], int), body
        # the client helper bench and the tests use reads the same body from a 5xx
        again = post_json(router + "/generate", {"prompt_len": 8}, 30)
        assert again["ok"] is (status == 200) and says in again["reason"]
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=30)
        finally:
            reap(proc)
    if status != 200:
        logged = "request refused (Unavailable)" if status == 503 else "request failed: room"
        assert logged in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    "prefill,decode,says",
    [
        ([1, 2], OK_DECODE, "prefill gave a malformed answer: a JSON list, not an object"),
        (
            OK_PREFILL,
            {**OK_DECODE, "bytes": "lots"},
            "decode gave a malformed answer: Expected `int`, got `str` - at `$.bytes`",
        ),
        ({**OK_PREFILL, "first_token": "three"}, OK_DECODE, "prefill gave a malformed answer: Expected `int | null`"),
        (OK_PREFILL, {**OK_DECODE, "output_tokens": {"0": 3}}, "decode gave a malformed answer"),
        ({**OK_PREFILL, "transfer_ms": -1.0}, OK_DECODE, "prefill gave a malformed answer: Expected `float` >= 0.0"),
    ],
)
def test_a_malformed_worker_answer_is_a_failed_request_that_says_why(workers, prefill, decode, says):
    """A worker's answer is untrusted: one the router cannot read fails the request (502, as
    any failure a worker reports) with the reason, and the router goes on serving."""
    proc, router = _router(workers(prefill), workers(decode))
    try:
        out = post_json(router + "/generate", {"prompt_len": 8}, 30)
        assert out["ok"] is False and out["status"] == 502 and says in out["reason"], out
        assert "timings_ms" in out and isinstance(out["room"], int)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "request failed: room" in err and "Traceback" not in err


@pytest.mark.parametrize("fanout", [2, None])
def test_the_answer_names_a_fan_out_prefill_made_and_leaves_it_out_otherwise(workers, fanout):
    """`fanout`: the decode ranks one prefill rank wrote as one (transfer.fanout), from
    prefill's report; absent where every send went on its own."""
    prefill = {**OK_PREFILL, "fanout": fanout} if fanout else OK_PREFILL
    proc, router = _router(workers(prefill), workers(OK_DECODE))
    try:
        out = post_json(router + "/generate", {"prompt_len": 8}, 30)
        assert out["ok"] and out.get("fanout") == fanout, out
    finally:
        proc.terminate()
        proc.communicate(timeout=30)
