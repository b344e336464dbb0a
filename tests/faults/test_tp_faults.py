"""TP instances, real processes, one rank killed mid-transfer: the requests it took part in
fail on every rank of both instances (the router aborts the others), every surviving rank's
pool returns to its initial counts within the bound, and the instance serves again once the
rank is restarted."""

import signal
import threading
import time

import pytest

from disagg.tools.demo import urls
from disagg.tools.launcher import Launcher
from fault_stack import device_args, inflight, pool_free, requests, until_ready

pytestmark = pytest.mark.slow

DEAD_AFTER = 2.0
QUARANTINE = 3.0
COMMON = [
    "--preset",
    "gpt-oss-20b",
    "--max-tokens",
    "16384",
    "--max-requests",
    "16",
    "--waiting-timeout",
    "15",
    "--transfer-timeout",
    "15",
    "--dead-after",
    str(DEAD_AFTER),
]
BOUND = DEAD_AFTER + QUARANTINE + 15
LENGTHS = [3000 + i for i in range(6)]


def _router(launcher: Launcher, prefill: list[dict], decode: list[dict]) -> str:
    return until_ready(
        launcher.start("router", "--pair", f"{urls(prefill)},{urls(decode)},{prefill[0]['bootstrap']}")["http"]
    )


def _kill_mid_flight(launcher, router, victim: dict, watch: list[dict], eventually) -> list[dict]:
    """Run a batch, SIGKILL `victim` once requests are in flight on it; the batch's answers."""
    results: list[dict] = []
    batch = threading.Thread(target=lambda: results.extend(requests(router, LENGTHS)))
    batch.start()
    eventually(lambda: all(inflight(r["http"]) > 0 for r in watch), 30, "requests in flight")
    proc = next(p for p in launcher.procs if p.pid == victim["pid"])
    proc.send_signal(signal.SIGKILL)
    batch.join(60)
    assert not batch.is_alive() and any(not r["ok"] for r in results)
    return results


def test_kill_one_prefill_rank_mid_transfer(eventually):
    """Prefill TP 2 -> decode TP 1: the decode rank receives from both prefill ranks."""
    with Launcher() as launcher:
        prefill = launcher.start_instance(
            "prefill", 2, *COMMON, *device_args("prefill"), "--bootstrap-bind", "tcp://127.0.0.1:*"
        )
        decode = launcher.start_instance(
            "decode",
            1,
            *COMMON,
            *device_args("decode"),
            "--quarantine",
            str(QUARANTINE),
            "--bootstrap-addr",
            prefill[0]["bootstrap"],
        )
        router = _router(launcher, prefill, decode)
        survivors = [prefill[0], decode[0]]
        initial = {r["http"]: pool_free(r["http"]) for r in survivors}
        assert all(r["ok"] and r["verified"] for r in requests(router, [500]))
        t0 = time.monotonic()
        _kill_mid_flight(launcher, router, prefill[1], [prefill[1], decode[0]], eventually)
        for r in survivors:
            eventually(lambda r=r: pool_free(r["http"]) == initial[r["http"]], BOUND, f"{r['http']} slots back")
        assert time.monotonic() - t0 < BOUND + 60
        # rank 1 restarted (a new epoch, registering with rank 0's bootstrap): served again
        again = launcher.start(
            "prefill",
            *COMMON,
            *device_args("prefill"),
            "--tp-size",
            "2",
            "--tp-rank",
            "1",
            "--bootstrap-bind",
            "none",
            "--bootstrap-addr",
            prefill[0]["bootstrap"],
        )
        router2 = _router(launcher, [prefill[0], again], decode)
        assert all(r["ok"] and r["verified"] for r in requests(router2, [100, 2000, 3000]))
        assert all(pool_free(r["http"]) == initial[r["http"]] for r in survivors), [
            (pool_free(r["http"]), initial[r["http"]]) for r in survivors
        ]


def test_kill_one_decode_rank_mid_transfer(eventually):
    """Prefill TP 1 -> decode TP 2: the prefill rank sends each decode rank half the heads."""
    with Launcher() as launcher:
        prefill = launcher.start_instance(
            "prefill", 1, *COMMON, *device_args("prefill"), "--bootstrap-bind", "tcp://127.0.0.1:*"
        )
        decode_args = [
            *COMMON,
            *device_args("decode"),
            "--quarantine",
            str(QUARANTINE),
            "--bootstrap-addr",
            prefill[0]["bootstrap"],
        ]
        decode = launcher.start_instance("decode", 2, *decode_args)
        router = _router(launcher, prefill, decode)
        survivors = [prefill[0], decode[0]]
        initial = {r["http"]: pool_free(r["http"]) for r in survivors}
        assert all(r["ok"] and r["verified"] for r in requests(router, [500]))
        _kill_mid_flight(launcher, router, decode[1], [prefill[0], decode[1]], eventually)
        for r in survivors:
            eventually(lambda r=r: pool_free(r["http"]) == initial[r["http"]], BOUND, f"{r['http']} slots back")
        again = launcher.start("decode", *decode_args, "--tp-size", "2", "--tp-rank", "1")
        router2 = _router(launcher, prefill, [decode[0], again])
        assert all(r["ok"] and r["verified"] for r in requests(router2, [100, 2000, 3000]))
        assert all(pool_free(r["http"]) == initial[r["http"]] for r in survivors), [
            (pool_free(r["http"]), initial[r["http"]]) for r in survivors
        ]
