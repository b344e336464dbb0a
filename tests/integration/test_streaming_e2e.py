"""Layer-wise streaming through real processes (prefill, decode, router; Mooncake TCP on
loopback): with a simulated per-layer compute time the first KV write leaves prefill before
its last layer is computed, every streamed request verifies on decode, and both pools return
to their initial free counts."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg.router.router import post_json
from disagg.tools.launcher import Launcher
from test_e2e import pool_free

pytestmark = pytest.mark.slow

LAYER_MS = 60  # tiny-hybrid has 6 layers: 360 ms of "compute" per prefill


@pytest.fixture(scope="module", params=[("page_major", "direct"), ("layer_major", "staged")], ids=str)
def stack(request):
    layout, mode = request.param
    common = [
        "--preset",
        "tiny-hybrid",
        "--max-tokens",
        "8192",
        "--device",
        "cpu",
        "--max-requests",
        "16",
        "--staging-slot-mib",
        "1",
        "--layout",
        layout,
        "--transfer-mode",
        mode,
    ]
    with Launcher() as launcher:
        prefill = launcher.start(
            "prefill",
            *common,
            "--bootstrap-bind",
            "tcp://127.0.0.1:*",
            "--simulate-layer-ms",
            str(LAYER_MS),
            "--stream-group-ms",
            "0.001",
            "--stream-layers",
            "auto",
            "--stream-min-tokens",
            "1000",
        )
        decode = launcher.start("decode", *common, "--bootstrap-addr", prefill["bootstrap"])
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        url = router["http"] + "/generate"
        warm = post_json(url, {"prompt_len": 8, "max_new_tokens": 2, "stream_layers": "off"}, 60)
        assert warm["ok"], warm["reason"]  # registration done: decode's TransferRequest comes at once now
        yield {"prefill": prefill, "decode": decode, "url": url, "mode": mode}


def test_streamed_requests_write_before_the_last_layer_and_verify(stack):
    before = pool_free(stack["prefill"]["http"]), pool_free(stack["decode"]["http"])
    r = post_json(stack["url"], {"prompt_len": 300, "max_new_tokens": 4, "seed": 1, "stream_layers": "on"}, 60)
    assert r["ok"] and r["verified"], r["reason"]
    assert r["streamed"] and r["layer_groups"] == 6 and r["mode"] == stack["mode"]
    # the first group left once layers 0 was final: about 5 of the 6 layers' compute before the end
    assert r["first_write_before_compute_end_ms"] > LAYER_MS, r
    assert r["timings_ms"]["kv_ready_after_compute"] is not None
    assert (pool_free(stack["prefill"]["http"]), pool_free(stack["decode"]["http"])) == before


def test_off_auto_and_concurrent_streams(stack):
    before = pool_free(stack["prefill"]["http"]), pool_free(stack["decode"]["http"])
    bodies = [
        {"prompt_len": 300, "max_new_tokens": 3, "seed": 2, "stream_layers": "off"},  # never streamed
        {"prompt_len": 999, "max_new_tokens": 3, "seed": 3},  # auto, below 1000
        *({"prompt_len": 1200 + i, "max_new_tokens": 3, "seed": 4 + i} for i in range(4)),
    ]  # auto: streamed
    with ThreadPoolExecutor(len(bodies)) as pool:
        results = list(pool.map(lambda b: post_json(stack["url"], b, 60), bodies))
    assert all(r["ok"] and r["verified"] for r in results), [r["reason"] for r in results]
    assert [r["streamed"] for r in results] == [False, False, True, True, True, True]
    assert [r["layer_groups"] for r in results[:2]] == [1, 1]
    assert (pool_free(stack["prefill"]["http"]), pool_free(stack["decode"]["http"])) == before


def test_a_bad_stream_layers_value_is_a_400_that_changes_nothing(stack):
    before = pool_free(stack["prefill"]["http"])
    r = post_json(stack["url"], {"prompt_len": 8, "stream_layers": "sometimes"}, 10)
    assert r["status"] == 400 and "stream_layers must be one of auto, on, off" in r["reason"]
    r = post_json(stack["prefill"]["http"] + "/prefill", {"room": 5, "token_ids": [1, 2], "stream_layers": 1}, 10)
    assert r["status"] == 400 and "stream_layers must be one of" in r["reason"]
    assert pool_free(stack["prefill"]["http"]) == before
