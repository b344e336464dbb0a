"""Decode's and prefill's prefix caches with real processes on loopback (stand-in engine,
Mooncake between every pair of ranks): a second turn moves only its suffix and still verifies
every byte (the reused prefix included), TP and page-size differences included, while prefill
computes only what follows its own cached prefix (shorter or longer than decode's: the two
are independent); small decode and prefill pools under many conversations keep admitting by
evicting, and every count comes back; transfers that fail midway leave nothing in decode's
cache (a later turn that reused their pages would fail its byte check)."""

import json
import random
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from disagg.api import metrics
from disagg.router.router import post_json
from disagg.tools.demo import urls
from disagg.tools.launcher import Launcher

pytestmark = pytest.mark.slow

STACKS = {  # id: (preset, prefill TP, decode TP, prefill page size, decode page size)
    "hybrid 1->1, pages 4": ("tiny-hybrid", 1, 1, 4, 4),
    "gpt-oss-like 1->2, pages 4->16": ("tiny-swa", 1, 2, 4, 16),
}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.read().decode()


def figure(http: str, name: str) -> float:
    return sum(
        s.value for f in text_string_to_metric_families(_get(http + "/metrics")) for s in f.samples if s.name == name
    )


def generate(router: str, tokens: list[int], new: int = 5) -> dict:
    return post_json(router + "/generate", {"token_ids": tokens, "max_new_tokens": new}, 60)


def launch(
    launcher: Launcher, preset: str, n: int, m: int, p_page: int, d_page: int, prefill_more=(), decode_more=()
) -> dict:
    common = ["--preset", preset, "--device", "cpu", "--max-requests", "8", "--staging-slot-mib", "1"]
    prefill = launcher.start_instance(
        "prefill",
        n,
        *common,
        "--max-tokens",
        "4096",
        "--page-size",
        str(p_page),
        "--bootstrap-bind",
        "tcp://127.0.0.1:*",
        *prefill_more,
    )
    decode = launcher.start_instance(
        "decode", m, *common, "--page-size", str(d_page), "--bootstrap-addr", prefill[0]["bootstrap"], *decode_more
    )
    router = launcher.start("router", "--pair", f"{urls(prefill)},{urls(decode)},{prefill[0]['bootstrap']}")
    return {"prefill": prefill, "decode": decode, "router": router["http"], "page": d_page}


@pytest.fixture(scope="module", params=list(STACKS))
def stack(request):
    preset, n, m, p_page, d_page = STACKS[request.param]
    with Launcher() as launcher:
        yield launch(launcher, preset, n, m, p_page, d_page, decode_more=["--max-tokens", "4096"])


def test_a_second_turn_moves_only_its_suffix_and_verifies(stack):
    router, ranks, page = stack["router"], [r["http"] for r in stack["decode"]], stack["page"]
    prefill = stack["prefill"][0]["http"]
    rng = random.Random(1)
    first = [rng.randrange(50000) for _ in range(203)]
    one = generate(router, first)
    assert one["ok"] and one["verified"], one.get("reason")
    assert one["prefill_cached_tokens"] == 0
    computed_before = figure(prefill, "disagg_prefix_cache_hit_tokens_total")
    second = first + one["output_tokens"][:4] + [rng.randrange(50000) for _ in range(40)]
    saved_before = sum(figure(h, "disagg_prefix_cache_saved_bytes_total") for h in ranks)
    hits_before = sum(figure(h, "disagg_prefix_cache_hit_tokens_total") for h in ranks)
    queried_before = sum(figure(h, "disagg_prefix_cache_queried_tokens_total") for h in ranks)
    two = generate(router, second)
    fresh = generate(router, [rng.randrange(50000) for _ in range(len(second))])  # the same length, no hit
    assert two["ok"] and two["verified"], two.get("reason")  # the stand-in checked every byte, prefix too
    assert fresh["ok"] and fresh["verified"], fresh.get("reason")
    held = (203 + 4) // page * page  # turn one's whole pages (prompt + 4 generated)
    hits = sum(figure(h, "disagg_prefix_cache_hit_tokens_total") for h in ranks) - hits_before
    assert hits == held * len(ranks)
    queried = sum(figure(h, "disagg_prefix_cache_queried_tokens_total") for h in ranks) - queried_before
    assert queried == 2 * len(second) * len(ranks)  # the second turn and the fresh prompt, on every rank
    saved = sum(figure(h, "disagg_prefix_cache_saved_bytes_total") for h in ranks) - saved_before
    assert 0 < two["bytes"] < fresh["bytes"] / 3 and saved > 0
    # the router's answer says what decode reused: the positions every rank held, the bytes of all
    assert (two["prefix_tokens"], two["reused_bytes"]) == (held, saved)
    assert (fresh["prefix_tokens"], fresh["reused_bytes"]) == (0, 0)
    # prefill computed only what follows turn one's whole pages (its page is 4): the prompt's
    # first 200 of its 203 tokens; decode held 204 (pages of 4) or 192 (pages of 16) of them
    assert (two["prefill_cached_tokens"], fresh["prefill_cached_tokens"]) == (200, 0)
    assert figure(prefill, "disagg_prefix_cache_hit_tokens_total") - computed_before == 200
    if len(ranks) == 1 and page == 4:  # pages alike on both sides: what moved + what was reused = all
        assert two["bytes"] + saved == fresh["bytes"]


def test_the_cache_is_in_health_and_every_count_comes_back(stack):
    for rank in stack["decode"] + stack["prefill"]:
        cache = json.loads(_get(rank["http"] + "/health"))["prefix_cache"]
        assert cache["cached_tokens"] > 0 and cache["unused_tokens"] == cache["cached_tokens"], cache
        assert metrics.pool_free(_get(rank["http"] + "/metrics"))["full_tokens"] == 4096


def conversation(router: str, seed: int, turns: int, shared: list[int]) -> list[dict]:
    """Turns that each resend the conversation so far (a shared system prompt first)."""
    rng = random.Random(seed)
    prompt, out = shared + [rng.randrange(50000) for _ in range(rng.randrange(5, 60))], []
    for _ in range(turns):
        r = generate(router, prompt, new=rng.randrange(1, 8))
        out.append(r)
        prompt = (
            prompt
            + (r["output_tokens"] if r["ok"] else [])
            + [rng.randrange(50000) for _ in range(rng.randrange(3, 50))]
        )
    return out


@pytest.mark.parametrize("faults", ["", "send.write=0.3"])
def test_a_full_cache_keeps_admitting_and_failed_transfers_leave_nothing(faults):
    """Decode and prefill hold 1024 tokens each: far less than the conversations; with faults,
    a third of the writes fail midway, and the next turn of that conversation would reuse the
    half-written pages if decode had cached them (its byte check would fail). Prefill keeps
    what it computed either way (a failed send does not change it)."""
    more = ["--inject-faults", faults, "--fault-seed", "3"] if faults else []
    with Launcher() as launcher:
        s = launch(
            launcher,
            "tiny-hybrid",
            1,
            1,
            4,
            4,
            prefill_more=[*more, "--max-tokens", "1024", "--queue-wait", "20"],
            decode_more=["--max-tokens", "1024", "--queue-wait", "20"],
        )
        workers = [s["decode"][0]["http"], s["prefill"][0]["http"]]
        start = {http: metrics.pool_free(_get(http + "/metrics")) for http in workers}
        shared = [7] * 64
        with ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(lambda i: conversation(s["router"], i, 5, shared), range(12)))
        answers = [r for run in runs for r in run]
        failed = [r for r in answers if not r["ok"]]
        assert all(r["verified"] for r in answers if r["ok"])
        assert all("verif" not in r.get("reason", "") for r in failed), [r["reason"] for r in failed]
        assert bool(failed) == bool(faults), [r.get("reason") for r in failed]
        for http in workers:
            assert figure(http, "disagg_prefix_cache_evicted_tokens_total") > 0, http
            assert figure(http, "disagg_prefix_cache_hit_tokens_total") > 0, http
            cache = json.loads(_get(http + "/health"))["prefix_cache"]
            assert cache["unused_tokens"] == cache["cached_tokens"], cache  # no request holds any
            assert metrics.pool_free(_get(http + "/metrics")) == start[http]  # nothing leaked
