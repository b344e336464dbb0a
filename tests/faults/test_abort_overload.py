"""Aborts and overload through the router, on real processes. Prefill here loses every
TransferDone (injected), so a request hangs on decode until its 30 s transfer deadline unless
something aborts it: each test shows the abort arriving in a few seconds instead, and every
slot coming back."""

import http.client
import json
import socket
import threading
import time
import urllib.parse

import pytest

from disagg.tools.launcher import Launcher
from disagg.router.router import post_json
from fault_stack import inflight, pool_free

pytestmark = pytest.mark.slow

SLOW = ["--bootstrap-timeout", "30", "--waiting-timeout", "30", "--transfer-timeout", "30"]
COMMON = ["--preset", "tiny-hybrid", "--device", "cpu", "--max-requests", "8", *SLOW]


@pytest.fixture(scope="module")
def stack():
    with Launcher() as launcher:
        prefill = launcher.start(
            "prefill",
            *COMMON,
            "--max-tokens",
            "16384",
            "--bootstrap-bind",
            "tcp://127.0.0.1:*",
            "--inject-faults",
            "control.drop_done=1.0",
        )
        decode = launcher.start(
            "decode", *COMMON, "--max-tokens", "1024", "--queue-wait", "0.5", "--bootstrap-addr", prefill["bootstrap"]
        )
        router = launcher.start(
            "router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}", "--max-inflight", "2"
        )["http"]
        initial = pool_free(prefill["http"]), pool_free(decode["http"])
        yield {"prefill": prefill["http"], "decode": decode["http"], "router": router, "initial": initial}


def _back(stack) -> bool:
    return (
        (pool_free(stack["prefill"]), pool_free(stack["decode"])) == stack["initial"]
        and inflight(stack["prefill"]) == 0
        and inflight(stack["decode"]) == 0
    )


class Hanging:
    """A /generate that hangs (its TransferDone is lost) until aborted or cut off."""

    def __init__(self, router: str, prompt_len: int, request_id: str | None = None):
        body = {"prompt_len": prompt_len, **({"request_id": request_id} if request_id else {})}
        url = urllib.parse.urlsplit(router)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
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


def test_decode_refusing_at_once_aborts_the_prefill_side(stack, eventually):
    t0 = time.monotonic()
    out = post_json(stack["router"] + "/generate", {"prompt_len": 4000}, 60)  # decode's pool holds 1024
    assert not out.get("ok") and "does not fit" in out["reason"], out
    assert time.monotonic() - t0 < 5, "prefill waited for its 30 s bootstrap deadline"
    eventually(lambda: _back(stack), 5, "both pools back")


def test_client_disconnect_aborts_both_sides(stack, eventually):
    hang = Hanging(stack["router"], 300)
    eventually(
        lambda: inflight(stack["decode"]) == 1 and inflight(stack["prefill"]) == 0,
        10,
        "the request hangs on decode (prefill finished, its TransferDone lost)",
    )
    t0 = time.monotonic()
    hang.conn.sock.shutdown(socket.SHUT_RDWR)  # the client goes away (FIN)
    eventually(lambda: _back(stack), 5, "the router aborted decode; decode's pages are back")
    assert time.monotonic() - t0 < 5
    hang.thread.join(10)


def test_abort_by_request_id(stack, eventually):
    hang = Hanging(stack["router"], 300, request_id="job-7")
    eventually(lambda: inflight(stack["decode"]) == 1, 10, "the request hangs on decode")
    dup = post_json(stack["router"] + "/generate", {"prompt_len": 10, "request_id": "job-7"}, 10)
    assert dup.get("status") == 400 and "already in flight" in dup["reason"]
    assert post_json(stack["router"] + "/abort", {"request_id": "job-7"}, 10) == {
        "request_id": "job-7",
        "aborted": True,
    }
    hang.thread.join(10)
    assert hang.result["status"] == 409 and hang.result["body"]["reason"] == "cancelled by the client"
    eventually(lambda: _back(stack), 5, "both pools back")
    assert post_json(stack["router"] + "/abort", {"request_id": "job-7"}, 10)["aborted"] is False


def test_overload_is_refused_at_once_with_503(stack, eventually):
    """Router: at most 2 in flight. Decode: its pool is full -> a 0.5 s wait, then 503; the
    prefill side of that request is aborted, not left to its deadline."""
    first = Hanging(stack["router"], 700, request_id="a")
    eventually(lambda: inflight(stack["decode"]) == 1, 10, "the first request holds most of decode's pool")
    t0 = time.monotonic()
    second = post_json(stack["router"] + "/generate", {"prompt_len": 700}, 30)
    assert second.get("status") == 503 and "pool full" in second["reason"], second
    assert time.monotonic() - t0 < 5
    third = Hanging(stack["router"], 100, request_id="c")
    eventually(lambda: inflight(stack["decode"]) == 2, 10, "two requests in flight at the router")
    fourth = post_json(stack["router"] + "/generate", {"prompt_len": 10}, 30)
    assert fourth.get("status") == 503 and "2 requests in flight" in fourth["reason"], fourth
    for request_id in ("a", "c"):
        post_json(stack["router"] + "/abort", {"request_id": request_id}, 10)
    first.thread.join(10)
    third.thread.join(10)
    eventually(lambda: _back(stack), 5, "both pools back")
