"""On a GPU (marked `gpu`: deselected where torch sees no CUDA device, tests/conftest.py): a TP 1
prefill rank feeding a TP 2 decode instance over cuda-ipc, real processes behind a router,
streaming off, sends both decode ranks as ONE fan-out (prefill/jobs.py, transfer.fanout: one
plan, one launch): the answer says so (`fanout`), every decode rank verifies every byte it
holds (the stand-in recomputes them), and every pool comes back. The same path on the CPU,
over a stand-in fan, is tests/disagg/prefill/test_fan_out.py's."""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg.router.router import post_json
from disagg.tools.demo import urls
from disagg.tools.launcher import Launcher
from test_e2e import pool_free

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

DEVICE = os.environ.get("DISAGG_TEST_DEVICE", "cuda")
DEVICE = DEVICE if DEVICE.startswith("cuda") else "cuda"  # (the pools must be on CUDA for cuda-ipc)
COMMON = [
    "--preset",
    "tiny-swa",
    "--max-tokens",
    "4096",
    "--max-requests",
    "8",
    "--device",
    DEVICE,
    "--transport",
    "cuda-ipc",
    "--staging-slot-mib",
    "1",
]


@pytest.mark.parametrize("decode_tp", [2])
def test_prefill_tp1_sends_every_decode_rank_as_one_fan_out_and_each_verifies(decode_tp):
    with Launcher() as launcher:
        prefill = launcher.start_instance(
            "prefill", 1, *COMMON, "--stream-layers", "off", "--bootstrap-bind", "tcp://127.0.0.1:*"
        )
        decode = launcher.start_instance("decode", decode_tp, *COMMON, "--bootstrap-addr", prefill[0]["bootstrap"])
        router = launcher.start("router", "--pair", f"{urls(prefill)},{urls(decode)},{prefill[0]['bootstrap']}")
        ranks = [r["http"] for r in (*prefill, *decode)]
        before = {http: pool_free(http) for http in ranks}
        lengths = [1, 17, 333, 2000]
        with ThreadPoolExecutor(len(lengths)) as pool:
            results = list(
                pool.map(
                    lambda n: post_json(
                        router["http"] + "/generate", {"prompt_len": n, "max_new_tokens": 2, "seed": n}, 120
                    ),
                    lengths,
                )
            )
        for n, r in zip(lengths, results):
            assert r["ok"] and r["verified"], (n, r.get("reason"))
            assert r["transport"] == "cuda-ipc" and not r["streamed"] and r["bytes"] > 0, (n, r)
            assert r.get("fanout") == decode_tp, (n, r)  # one write into every decode rank
        assert {http: pool_free(http) for http in ranks} == before
