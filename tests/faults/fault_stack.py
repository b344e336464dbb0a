"""What the fault tests read from running workers (their /metrics) and how they load them."""

import os
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from disagg.api import metrics
from disagg.tools.launcher import Launcher
from disagg.router.router import post_json


def _metrics(http: str) -> str:
    with urllib.request.urlopen(http + "/metrics", timeout=10) as resp:
        return resp.read().decode()


def pool_free(http: str) -> dict:
    return metrics.pool_free(_metrics(http))


def inflight(http: str) -> float:
    return metrics.inflight(_metrics(http))


def requests(router: str, lengths: list[int]) -> list[dict]:
    with ThreadPoolExecutor(len(lengths)) as pool:
        return list(pool.map(lambda n: post_json(router + "/generate", {"prompt_len": n, "seed": n}, 60), lengths))


def router_ready(http: str) -> bool:
    try:
        with urllib.request.urlopen(http + "/ready", timeout=10) as resp:
            return resp.status == 200
    except OSError:  # (HTTPError: 503 while no pair is up)
        return False


def until_ready(http: str, timeout: float = 30.0) -> str:
    """`http` once the router's /ready is true: a side that was just (re)started is up only once
    decode has registered with its prefill (ReadinessWatch, every second) and the router has
    looked (PairMonitor, every second); until then the router answers 503, as it should."""
    deadline = time.monotonic() + timeout
    while not router_ready(http):  # (a condition with a deadline, as tests/conftest.py's eventually)
        assert time.monotonic() < deadline, f"router {http} not ready within {timeout} s"
        time.sleep(0.05)
    return http


def start_router(launcher: Launcher, prefill: dict, decode: dict) -> str:
    return until_ready(
        launcher.start("router", "--pair", f"{prefill['http']},{decode['http']},{prefill['bootstrap']}")["http"]
    )


def device_args(role: str) -> list[str]:
    """--device for a worker of `role`: cpu, or on a GPU machine (DISAGG_TEST_DEVICE=cuda) the
    first GPU for prefill and the second, where there is one, for decode."""
    device = os.environ.get("DISAGG_TEST_DEVICE", "cpu")
    if not device.startswith("cuda"):
        return ["--device", device]
    import torch

    index = 1 if role == "decode" and torch.cuda.device_count() > 1 else 0
    return ["--device", f"cuda:{index}"]
