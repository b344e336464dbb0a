"""prefill and decode in different network namespaces, KV over Mooncake TCP between them."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg.launcher import Launcher
from disagg.router import post_json

pytestmark = [pytest.mark.twonode, pytest.mark.slow]


def start_pair(launcher: Launcher, hosts, p: int, d: int, preset: str, extra=()) -> tuple[dict, dict]:
    common = ["--preset", preset, "--max-tokens", "8192", "--device", "cpu", "--max-requests", "16",
              "--staging-slot-mib", "1", "--request-timeout", "20", *extra]
    prefill = launcher.start("prefill", *common, "--host", hosts.data(p), "--http-host", hosts.front(p),
                             "--bootstrap-bind", f"tcp://{hosts.data(p)}:*", prefix=hosts.prefix(p))
    decode = launcher.start("decode", *common, "--host", hosts.data(d), "--http-host", hosts.front(d),
                            "--bootstrap-addr", prefill["bootstrap"], prefix=hosts.prefix(d))
    return prefill, decode


def run_requests(router: str, lengths: list[int]) -> list[dict]:
    with ThreadPoolExecutor(6) as pool:
        return list(pool.map(lambda n: post_json(router + "/generate", {"prompt_len": n, "max_new_tokens": 3,
                                                                        "seed": n}, 90), lengths))


@pytest.mark.parametrize("preset,extra", [("tiny-swa", ()), ("tiny-mla-nsa", ()), ("tiny-mamba", ()),
                                          ("tiny-full", ()), ("tiny-hybrid", ("--transfer-mode", "staged"))])
def test_1p1d_across_namespaces(hosts4, preset, extra):
    with Launcher() as launcher:
        prefill, decode = start_pair(launcher, hosts4, 1, 2, preset, extra)
        assert prefill["session"].startswith(hosts4.data(1)) and decode["session"].startswith(hosts4.data(2))
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        results = run_requests(router["http"], [5, 60, 333, 1200, 2000, 17])
    for r in results:
        assert r["ok"] and r["verified"], r.get("reason")


def test_2p2d_behind_one_router(hosts4):
    with Launcher() as launcher:
        pairs = [start_pair(launcher, hosts4, 1, 2, "tiny-hybrid"), start_pair(launcher, hosts4, 3, 4, "tiny-hybrid")]
        router = launcher.start("router", *[arg for p, d in pairs
                                            for arg in ("--pair", f"{p['http']},{d['http']},{p['bootstrap']}")])
        results = run_requests(router["http"], [40 + 97 * i for i in range(12)])
    assert all(r["ok"] and r["verified"] for r in results), [r.get("reason") for r in results]
    assert {r["pair"] for r in results} == {0, 1}
