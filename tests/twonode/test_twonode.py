"""prefill and decode in different network namespaces, KV over Mooncake TCP between them."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from disagg.api import metrics
from disagg.tools.launcher import Launcher
from disagg.router.router import post_json

pytestmark = [pytest.mark.twonode, pytest.mark.slow]


def start_pair(launcher: Launcher, hosts, p: int, d: int, preset: str, extra=()) -> tuple[dict, dict]:
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
        "--transfer-timeout",
        "20",
        *extra,
    ]
    prefill = launcher.start(
        "prefill",
        *common,
        "--host",
        hosts.data(p),
        "--http-host",
        hosts.front(p),
        "--bootstrap-bind",
        f"tcp://{hosts.data(p)}:*",
        prefix=hosts.prefix(p),
    )
    decode = launcher.start(
        "decode",
        *common,
        "--host",
        hosts.data(d),
        "--http-host",
        hosts.front(d),
        "--bootstrap-addr",
        prefill["bootstrap"],
        prefix=hosts.prefix(d),
    )
    return prefill, decode


def run_requests(router: str, lengths: list[int]) -> list[dict]:
    with ThreadPoolExecutor(6) as pool:
        return list(
            pool.map(
                lambda n: post_json(router + "/generate", {"prompt_len": n, "max_new_tokens": 3, "seed": n}, 90),
                lengths,
            )
        )


@pytest.mark.parametrize(
    "preset,extra",
    [
        ("tiny-swa", ()),
        ("tiny-mla-nsa", ()),
        ("tiny-mamba", ()),
        ("tiny-full", ()),
        ("tiny-hybrid", ("--transfer-mode", "staged")),
    ],
)
def test_1p1d_across_namespaces(hosts4, preset, extra):
    with Launcher() as launcher:
        prefill, decode = start_pair(launcher, hosts4, 1, 2, preset, extra)
        assert prefill["transports"] == {"mooncake": hosts4.data(1)} and decode["transports"] == {
            "mooncake": hosts4.data(2)
        }
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        results = run_requests(router["http"], [5, 60, 333, 1200, 2000, 17])
    for r in results:
        assert r["ok"] and r["verified"], r.get("reason")


def test_2p2d_behind_one_router(hosts4):
    with Launcher() as launcher:
        pairs = [start_pair(launcher, hosts4, 1, 2, "tiny-hybrid"), start_pair(launcher, hosts4, 3, 4, "tiny-hybrid")]
        router = launcher.start(
            "router", *[arg for p, d in pairs for arg in ("--pair", f"{p['http']},{d['http']},{p['bootstrap']}")]
        )
        results = run_requests(router["http"], [40 + 97 * i for i in range(12)])
    assert all(r["ok"] and r["verified"] for r in results), [r.get("reason") for r in results]
    assert {r["pair"] for r in results} == {0, 1}


def _pool_free(http: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(http + "/metrics", timeout=10) as resp:
        return metrics.pool_free(resp.read().decode())


def _inflight(http: str) -> float:
    import urllib.request

    with urllib.request.urlopen(http + "/metrics", timeout=10) as resp:
        return metrics.inflight(resp.read().decode())


def test_link_cut_fails_affected_requests_within_the_deadline_and_recovers(hosts4, eventually):
    import threading

    deadline_s = 6.0
    with Launcher() as launcher:
        prefill, decode = start_pair(
            launcher,
            hosts4,
            1,
            2,
            "gpt-oss-20b",
            (
                "--max-tokens",
                "65536",
                *(f"--{phase}-timeout={deadline_s}" for phase in ("bootstrap", "waiting", "transfer")),
            ),
        )
        router = launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")
        before = (_pool_free(prefill["http"]), _pool_free(decode["http"]))
        assert all(r["ok"] for r in run_requests(router["http"], [1000, 2000]))  # warm: sessions exist

        results: list[dict] = []
        batch = threading.Thread(
            target=lambda: results.extend(run_requests(router["http"], [3000 + i for i in range(8)]))
        )
        batch.start()
        eventually(lambda: _inflight(prefill["http"]) > 0, 30, "prefill has requests in flight")
        hosts4.link(1, "down")
        try:
            during = run_requests(router["http"], [1500, 2500])  # sent while the data link is down
        finally:
            hosts4.link(1, "up")
        batch.join()
        failed = [r for r in results + during if not r["ok"]]
        assert failed, "the cut affected no request"
        assert all(r["timings_ms"]["total"] < (deadline_s + 6) * 1e3 for r in failed), [
            r["timings_ms"]["total"] for r in failed
        ]
        assert all(not r["verified"] for r in failed)
        assert all(r["ok"] for r in during) is False
        # the link is back: new requests succeed, and every slot comes back on both sides
        after = run_requests(router["http"], [700, 1800, 2600])
        assert all(r["ok"] and r["verified"] for r in after), [r.get("reason") for r in after]
        eventually(
            lambda: (_pool_free(prefill["http"]), _pool_free(decode["http"])) == before,
            90,
            "both pools back to their initial free counts",
        )
