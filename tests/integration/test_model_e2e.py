"""Real model code through real processes on loopback: prefill computes a tiny model's KV,
Mooncake moves it, decode continues from its own pool, and every request's tokens and logits
equal a colocated run (decode --check-rate 1). Per family; page sizes 1 and 16 and the
layer-major layout spread over the families (the engine tests run every family at both), and
two pairs whose sides keep pages of different sizes.
Also the router's OpenAI-compatible /v1/completions, plain and streamed."""

import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg.router.router import post_json
from disagg.tools.launcher import Launcher
from tests.integration.test_e2e import pool_free

pytestmark = pytest.mark.slow

STACKS = {  # id: (preset, flags of both sides, prefill's own, decode's own)
    "gpt-oss": ("tiny-model-gpt-oss", ["--page-size", "16"], [], []),
    "gemma3": ("tiny-model-gemma3", ["--page-size", "1"], [], []),
    "mimo": ("tiny-model-mimo", ["--page-size", "16", "--layout", "layer_major"], [], []),
    "qwen3-next": ("tiny-model-qwen3-next", ["--page-size", "16", "--transfer-mode", "staged"], [], []),
    "nemotron-h": ("tiny-model-nemotron-h", ["--page-size", "1"], [], []),
    "jamba": ("tiny-model-jamba", [], [], []),
    "deepseek-v3": ("tiny-model-deepseek-v3", ["--page-size", "1"], [], []),
    "deepseek-v32": ("tiny-model-deepseek-v32", ["--page-size", "16"], [], []),
    # pools of different page sizes (moved by token): SWA both ways and both layouts, state staged
    "gpt-oss-pages-4-to-16": ("tiny-model-gpt-oss", [], ["--page-size", "4"], ["--page-size", "16"]),
    "mimo-pages-16-to-1": ("tiny-model-mimo", ["--layout", "layer_major"], ["--page-size", "16"], ["--page-size", "1"]),
    "qwen3-next-pages-1-to-16": (
        "tiny-model-qwen3-next",
        ["--layout", "layer_major", "--transfer-mode", "staged"],
        ["--page-size", "1"],
        ["--page-size", "16"],
    ),
}
LENGTHS = [1, 5, 8, 9, 17, 40, 61]  # window 8: shorter, equal, one past, many windows; 61 % 16 != 0
VOCAB = 512


@pytest.fixture(scope="module", params=list(STACKS))
def stack(request):
    preset, flags, prefill_flags, decode_flags = STACKS[request.param]
    common = [
        "--preset",
        preset,
        "--device",
        "cpu",
        "--max-tokens",
        "4096",
        "--max-requests",
        "16",
        "--staging-slot-mib",
        "1",
        *flags,
    ]
    with Launcher() as launcher:
        prefill = launcher.start("prefill", *common, *prefill_flags, "--bootstrap-bind", "tcp://127.0.0.1:*")
        decode = launcher.start(
            "decode", *common, *decode_flags, "--bootstrap-addr", prefill["bootstrap"], "--check-rate", "1"
        )
        router = launcher.start(
            "router", "--vocab-size", str(VOCAB), "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}"
        )
        yield {"preset": preset, "prefill": prefill["http"], "decode": decode["http"], "router": router["http"]}


def test_disaggregated_generation_equals_colocated(stack):
    before = pool_free(stack["prefill"]), pool_free(stack["decode"])
    with ThreadPoolExecutor(len(LENGTHS)) as pool:
        results = list(
            pool.map(
                lambda n: post_json(
                    stack["router"] + "/generate", {"prompt_len": n, "max_new_tokens": 6, "seed": n}, 120
                ),
                LENGTHS,
            )
        )
    for n, r in zip(LENGTHS, results):
        assert r["ok"], (n, r.get("reason"))
        assert r["check"]["token_match"] and r["check"]["logits_match"], (n, r["check"])
        assert len(r["output_tokens"]) == 6 and all(0 <= t < VOCAB for t in r["output_tokens"])
    assert (pool_free(stack["prefill"]), pool_free(stack["decode"])) == before
    # a token id past the vocabulary: refused on both sides, nothing held
    bad = post_json(stack["router"] + "/generate", {"token_ids": [1, 2, VOCAB], "max_new_tokens": 2}, 30)
    assert bad["status"] == 400 and "outside the model's vocabulary of 512" in bad["reason"]
    assert (pool_free(stack["prefill"]), pool_free(stack["decode"])) == before


def _post(url: str, body: dict) -> tuple[int, bytes, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read(), resp.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "")


def test_openai_completions_plain_and_streamed(stack):
    url = stack["router"] + "/v1/completions"
    prompt = list(range(3, 3 + 21))
    want = post_json(stack["router"] + "/generate", {"token_ids": prompt, "max_new_tokens": 5}, 60)["output_tokens"]
    status, body, _ = _post(url, {"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0.0})
    out = json.loads(body)
    assert status == 200 and out["object"] == "text_completion" and out["model"] == "m"
    assert out["choices"][0]["token_ids"] == want and out["choices"][0]["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 21, "completion_tokens": 5, "total_tokens": 26}
    assert out["disagg"]["check"]["token_match"]

    status, body, ctype = _post(
        url,
        {
            "prompt": [prompt],
            "max_tokens": 5,
            "stream": True,
            "ignore_eos": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert status == 200 and ctype == "text/event-stream"
    events = [e.removeprefix("data: ") for e in body.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    tokens = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    assert tokens == want and len(chunks) == 6  # one chunk per token, then usage
    assert [c["choices"][0]["finish_reason"] for c in chunks[:5]] == [None] * 4 + ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5 and len({c["id"] for c in chunks}) == 1

    before = pool_free(stack["prefill"]), pool_free(stack["decode"])
    for body, field in [
        ({"prompt": "hello", "max_tokens": 2}, "tokenize on the client"),
        ({"prompt": prompt, "temperature": 0.7}, "temperature=0.7"),
        ({"prompt": prompt, "n": 2}, "n=2"),
        ({"prompt": prompt, "logprobs": 3}, "logprobs=3"),
        ({"prompt": prompt, "frobnicate": 1}, "unsupported field(s) frobnicate"),
        ({"prompt": prompt, "max_tokens": 0}, "max_tokens"),
        ({"prompt": []}, "non-empty"),
    ]:
        status, raw, _ = _post(url, body)
        assert status == 400 and field in json.loads(raw)["error"]["message"], (body, raw)  # OpenAI's error object
    status, raw, _ = _post(url, {"prompt": [VOCAB + 1], "stream": True})  # refused before the stream starts
    assert status == 400 and "vocabulary" in json.loads(raw)["error"]["message"]
    assert (pool_free(stack["prefill"]), pool_free(stack["decode"])) == before
