"""Real processes on loopback: prefill (with its bootstrap), decode and router, per family."""

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import zmq

from disagg.api import metrics
from disagg.tools.launcher import Launcher
from disagg.control.messages import PROTOCOL_VERSION, Decoder, RegisterDecode, Refused, ToDecode, encoder
from disagg.router.router import post_json

pytestmark = pytest.mark.slow

FAMILIES = {  # gpt-oss-like SWA, deepseek-like MLA + NSA, qwen3-next-like Mamba, plain full attention
    "tiny-swa": [],
    "tiny-mla-nsa": [],
    "tiny-mamba": [],
    "tiny-full": [],
    "tiny-hybrid": ["--transfer-mode", "staged"],
}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def pool_free(http: str) -> dict:
    text = _get(http + "/metrics")
    return metrics.pool_free(text)


@pytest.fixture(scope="module", params=list(FAMILIES))
def stack(request):
    preset = request.param
    common = [
        "--preset",
        preset,
        "--max-tokens",
        "8192",
        "--device",
        "cpu",
        "--max-requests",
        "16",
        "--staging-slot-mib",
        "1",
        *FAMILIES[preset],
    ]
    with Launcher() as launcher:
        prefill = launcher.start("prefill", *common, "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start("decode", *common, "--bootstrap-addr", prefill["bootstrap"])
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        yield {"preset": preset, "prefill": prefill, "decode": decode, "router": router}


def test_concurrent_requests_verify_and_slots_return(stack):
    prefill_before, decode_before = pool_free(stack["prefill"]["http"]), pool_free(stack["decode"]["http"])
    assert prefill_before and decode_before
    lengths = [1, 3, 17, 64, 100, 333, 1000, 1500]
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda n: post_json(
                    stack["router"]["http"] + "/generate", {"prompt_len": n, "max_new_tokens": 5, "seed": n}, 60
                ),
                lengths,
            )
        )
    for n, r in zip(lengths, results):
        assert r["ok"] and r["verified"], (n, r.get("reason"))
        assert len(r["output_tokens"]) == 5 and r["prompt_tokens"] == n
        assert r["transport"] == "mooncake"  # the one both sides offer, picked at registration
    assert len({r["room"] for r in results}) == len(results)
    if stack["preset"] == "tiny-hybrid":
        assert any(r["mode"] == "staged" for r in results)
    # the handlers free before they answer, so the counts are back by now
    assert pool_free(stack["prefill"]["http"]) == prefill_before
    assert pool_free(stack["decode"]["http"]) == decode_before


def test_health_ready_metrics(stack):
    for role in ("prefill", "decode", "router"):
        health = json.loads(_get(stack[role]["http"] + "/health"))
        assert health["status"] == "ok" and health["role"] == role, health
        if role != "router":
            assert health["preset"] == stack["preset"] and health["auth"] == "curve" and health["device"] == "cpu"
        ready = json.loads(_get(stack[role]["http"] + "/ready"))
        assert ready["ready"] is True and (role != "router" or ready["pairs_up"] == 1), ready
        assert "disagg_requests_total" in _get(stack[role]["http"] + "/metrics")


def test_hostile_control_frames_are_refused_and_the_pair_keeps_serving(stack, keyed):
    sock = keyed.client(keyed.ctx.socket(zmq.DEALER), "hostile dealer")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(stack["prefill"]["control"])
    decoder = Decoder(ToDecode, "test")
    try:
        sock.send(b"\xc1 not msgpack")
        assert sock.poll(10_000)
        reply = decoder.decode(sock.recv())
        assert isinstance(reply, Refused) and "undecodable" in reply.reason
        from disagg.control.messages import LayoutInfo

        sock.send(encoder.encode(RegisterDecode(99, 1, LayoutInfo(4, "page_major", []), [], None)))
        assert sock.poll(10_000)
        reply = decoder.decode(sock.recv())
        assert isinstance(reply, Refused) and "protocol version 99" in reply.reason
        from transfer.buffers import Buffer

        sock.send(
            encoder.encode(
                RegisterDecode(
                    PROTOCOL_VERSION, 1, LayoutInfo(4, "page_major", [Buffer(0, 64, 8, "full", 1, "k")]), [], None
                )
            )
        )
        assert sock.poll(10_000)
        reply = decoder.decode(sock.recv())
        assert isinstance(reply, Refused) and "layout mismatch" in reply.reason
    finally:
        sock.close()
    r = post_json(stack["router"]["http"] + "/generate", {"prompt_len": 50}, 60)
    assert r["ok"] and r["verified"]


@pytest.mark.parametrize(
    "body,code",
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"prompt_len": -1}', 400),
        (b'{"token_ids": "abc"}', 400),
        (b'{"prompt_len": 5, "max_new_tokens": 0}', 400),
    ],
)
def test_bad_http_input_gets_a_clear_error(stack, body, code):
    req = urllib.request.Request(stack["router"]["http"] + "/generate", body, {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == code and b"error" in err.value.read()
    bad = urllib.request.Request(
        stack["prefill"]["http"] + "/prefill", b'{"room": 1}', {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(bad, timeout=10)
    assert err.value.code == 400 and b"token_ids" in err.value.read()
    assert post_json(stack["router"]["http"] + "/generate", {"prompt_len": 9}, 60)["ok"]
