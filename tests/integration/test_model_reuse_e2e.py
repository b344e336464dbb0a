"""Decode's prefix cache with the model engine through real processes (Mooncake on loopback,
real ZMQ, the router in front): a conversation of three turns, each prompt the previous one,
its answer and a few new tokens, reuses decode's cached prefix from the second turn on
(decode's /health counts the hit tokens), prefill's digest of the new prompt covers the reused
bytes (verified), and decode's tokens and logits equal the colocated run's bit for bit
(--check-rate 1): for gpt-oss (SWA), qwen3-next (GDN), nemotron-h (Mamba2) and deepseek-v3.2
(MLA + NSA) at TP 1, prefill TP 2 to decode TP 1, and pages of different sizes. Prefill's own
prefix cache computes only what follows the last prompt's whole chunks where the engine can
resume with the same bits (gpt-oss, deepseek-v3.2 at TP 1: the colocated check then covers a
prefill hit and a decode hit together); with state layers or on a TP shard prefill computes
every prompt whole and its cache is off. A family whose model code cannot continue a cache
with chunked passes (jamba) runs without the cache."""

import json
import random
import urllib.request

import pytest

from disagg.router.router import post_json
from disagg.tools.demo import urls
from disagg.tools.launcher import Launcher

pytestmark = pytest.mark.slow

CHUNK = 8  # the tiny families' prefill passes (engine/model/reuse.py)
VOCAB = 512
STACKS = {  # id: (preset, prefill TP, decode TP, prefill page size, decode page size)
    "gpt-oss": ("tiny-model-gpt-oss", 1, 1, 4, 4),
    "qwen3-next": ("tiny-model-qwen3-next", 1, 1, 4, 4),
    "nemotron-h": ("tiny-model-nemotron-h", 1, 1, 4, 4),
    "deepseek-v32": ("tiny-model-deepseek-v32", 1, 1, 4, 4),
    "gpt-oss TP 2->1": ("tiny-model-gpt-oss", 2, 1, 4, 4),
    "nemotron-h pages 4->16": ("tiny-model-nemotron-h", 1, 1, 4, 16),
}
PREFILL_RESUMES = {"gpt-oss", "deepseek-v32"}  # prefill's cache on (state layers, a TP shard: off)


def _health(http: str) -> dict:
    with urllib.request.urlopen(http + "/health", timeout=10) as resp:
        return json.loads(resp.read().decode())


def launch(launcher: Launcher, preset: str, n: int, m: int, p_page: int, d_page: int) -> dict:
    common = [
        "--preset",
        preset,
        "--engine",
        "model",
        "--device",
        "cpu",
        "--max-tokens",
        "1024",
        "--max-requests",
        "4",
        "--staging-slot-mib",
        "1",
    ]
    prefill = launcher.start_instance(
        "prefill", n, *common, "--page-size", str(p_page), "--bootstrap-bind", "tcp://127.0.0.1:*"
    )
    decode = launcher.start_instance(
        "decode",
        m,
        *common,
        "--page-size",
        str(d_page),
        "--check-rate",
        "1",
        "--bootstrap-addr",
        prefill[0]["bootstrap"],
    )
    router = launcher.start(
        "router", "--vocab-size", str(VOCAB), "--pair", f"{urls(prefill)},{urls(decode)},{prefill[0]['bootstrap']}"
    )
    return {"decode": [r["http"] for r in decode], "router": router["http"], "page": d_page}


def hits(stack: dict) -> int:
    return sum(_health(h)["prefix_cache"]["hit_tokens"] for h in stack["decode"])


@pytest.mark.parametrize("stack_id", list(STACKS))
def test_three_turns_reuse_decodes_cache_and_equal_the_colocated_run(stack_id):
    preset, n, m, p_page, d_page = STACKS[stack_id]
    rng = random.Random(3)
    with Launcher() as launcher:
        s = launch(launcher, preset, n, m, p_page, d_page)
        prompt, cached, page = [rng.randrange(VOCAB) for _ in range(29)], 0, s["page"]
        for turn in range(3):
            before = hits(s)
            r = post_json(s["router"] + "/generate", {"token_ids": prompt, "max_new_tokens": 7}, 180)
            assert r["ok"] and r["verified"], (turn, r.get("reason"))
            assert r["check"]["token_match"] and r["check"]["logits_match"], (turn, r["check"])
            # the prefix it took: the last prompt's whole prefill chunks, in whole pages of
            # decode's, leaving prefill the prompt's last token
            want = min(cached // page * page, (len(prompt) - 1) // page * page)
            assert hits(s) - before == want * m and (turn == 0 or want > 0), (turn, want)
            if stack_id in PREFILL_RESUMES:  # whole chunks of the last prompt, whole pages, aligned
                skipped = min(cached, (len(prompt) - 1) // p_page * p_page) // CHUNK * CHUNK
                assert r["prefill_cached_tokens"] == skipped and (turn == 0 or skipped > 0), (turn, r)
            else:
                assert "prefill_cached_tokens" not in r, r
            cached = len(prompt) // CHUNK * CHUNK
            prompt = prompt + r["output_tokens"] + [rng.randrange(VOCAB) for _ in range(5)]


def test_a_family_that_cannot_continue_a_cache_runs_without_it():
    """jamba's code ignores the cache's state for a multi-token input: its prompts run in one
    pass and decode keeps no prefix cache (its startup log says why); turns stay exact."""
    with Launcher() as launcher:
        s = launch(launcher, "tiny-model-jamba", 1, 1, 4, 4)
        assert "prefix_cache" not in _health(s["decode"][0])
        rng = random.Random(1)
        prompt = [rng.randrange(VOCAB) for _ in range(21)]
        for _ in range(2):
            r = post_json(s["router"] + "/generate", {"token_ids": prompt, "max_new_tokens": 5}, 180)
            assert r["ok"] and r["verified"] and r["check"]["logits_match"], r.get("reason")
            prompt = prompt + r["output_tokens"] + [rng.randrange(VOCAB) for _ in range(5)]
