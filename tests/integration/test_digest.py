"""Issue 35, item 9: with the model engine, decode verifies the bytes that arrived, not only
what the model makes of them. Real prefill, decode and router processes (Mooncake on
loopback); decode flips one byte of every arrival (`decode.flip`): where the pool holds one, a
byte no decode step reads (the oldest position of the sliding window), so the outputs, and
the colocated check at --check-rate 1, are those of an intact KV. The request must fail
with the verification status (500, `verify: ...`), naming the unit, at TP 1, across TP
resharding (prefill TP 2 -> decode TP 1) and across page sizes (4 -> 16)."""

import json
import urllib.error
import urllib.request

import pytest

from disagg.tools.demo import urls
from disagg.tools.launcher import Launcher

pytestmark = pytest.mark.slow

VOCAB = 512
STACKS = {  # id: (preset, prefill TP, decode TP, prefill page size, decode page size, check rate)
    "gpt-oss TP 1, unread SWA byte, check-rate 1": ("tiny-model-gpt-oss", 1, 1, None, None, "1"),
    "qwen3-next TP 2 -> 1, state byte, check-rate 0": ("tiny-model-qwen3-next", 2, 1, None, None, "0"),
    "gpt-oss pages 4 -> 16, unread SWA byte, check-rate 0": ("tiny-model-gpt-oss", 1, 1, 4, 16, "0"),
}
WHERE = {"tiny-model-gpt-oss": "verify: swa layer ", "tiny-model-qwen3-next": "verify: mamba layer "}


def call(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module", params=list(STACKS))
def stack(request):
    preset, n, m, p_page, d_page, rate = STACKS[request.param]
    common = ["--preset", preset, "--engine", "model", "--device", "cpu", "--max-tokens", "1024", "--max-requests", "4"]
    page = lambda size: ["--page-size", str(size)] if size else []  # noqa: E731
    with Launcher() as launcher:
        prefill = launcher.start_instance("prefill", n, *common, *page(p_page), "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start_instance(
            "decode",
            m,
            *common,
            *page(d_page),
            "--bootstrap-addr",
            prefill[0]["bootstrap"],
            "--check-rate",
            rate,
            "--inject-faults",
            "decode.flip=1",
        )
        router = launcher.start(
            "router", "--vocab-size", str(VOCAB), "--pair", f"{urls(prefill)},{urls(decode)},{prefill[0]['bootstrap']}"
        )
        yield {"router": router["http"], "where": WHERE[preset]}


def test_a_flipped_byte_the_model_may_ignore_fails_the_request_with_the_verification_status(stack):
    status, body = call(stack["router"] + "/generate", {"prompt_len": 12, "max_new_tokens": 4, "seed": 3})
    assert status == 500 and body["status"] == 500 and not body["ok"] and not body["verified"], body
    assert body["reason"].startswith(stack["where"]), body
    assert "the bytes that arrived differ from those prefill wrote" in body["reason"], body
