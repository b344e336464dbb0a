"""A worker's /health says its load (issue 39), for every router in front of it: the requests
and prompt tokens it holds, queued (arrived, waiting for pool space) and running (admitted,
until answered), on real servers in this process (real ZMQ, real Mooncake on loopback, a
prefill engine held busy until released)."""

import threading

import numpy as np
import pytest

from disagg.control.deadlines import Deadlines
from disagg.control.load import IDLE, WorkerLoad, read_load
from disagg.decode.server import DecodeConfig, DecodeServer
from disagg.prefill.server import PrefillConfig, PrefillServer
from disagg.worker.pool_settings import PoolSettings

pytestmark = pytest.mark.slow
LONG = Deadlines(bootstrap_s=30, waiting_s=30, transfer_s=30)


def load(server) -> WorkerLoad:
    """Its /health's load, read as the router reads it."""
    return read_load(server.health()["load"])


@pytest.fixture
def pair(StuckEngine):
    """A prefill whose pool takes one request at a time and whose engine holds it until
    released, and a decode behind it."""
    pool = PoolSettings(preset="tiny-hybrid", max_tokens=2048, max_requests=4, device="cpu")
    stuck = StuckEngine()
    prefill = PrefillServer(
        PrefillConfig(
            pool=PoolSettings(preset="tiny-hybrid", max_tokens=2048, max_requests=1, device="cpu"),
            bootstrap_bind="tcp://127.0.0.1:*",
            deadlines=LONG,
            queue_wait_s=30,
        ),
        stuck,
    )
    decode = DecodeServer(DecodeConfig(pool=pool, bootstrap_addr=prefill.bootstrap_endpoint, deadlines=LONG))
    threads: list[threading.Thread] = []

    def run(fn, *args) -> dict:
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(fn(*args)), daemon=True)
        threads.append(t)
        t.start()
        return out

    yield prefill, decode, stuck, run
    stuck.release.set()
    for t in threads:
        t.join(30)
    prefill.close()
    decode.close()


def test_health_says_what_is_queued_and_running_until_it_is_answered(pair, eventually):
    prefill, decode, stuck, run = pair
    assert load(prefill) == IDLE and load(decode) == IDLE
    first, second = np.arange(300), np.arange(1000, 1200)
    outs = [run(prefill.prefill, 1, first), run(decode.decode, 1, first, 2)]
    assert stuck.entered.wait(10)  # room 1 computes (held): prefill's one request slot is taken
    outs += [run(prefill.prefill, 2, second), run(decode.decode, 2, second, 2)]
    eventually(lambda: prefill.admission.waiting == 1, 10, "room 2 waits for prefill's pool")
    assert load(prefill) == WorkerLoad(queued_requests=1, queued_tokens=200, running_requests=1, running_tokens=300)
    running = WorkerLoad(queued_requests=0, queued_tokens=0, running_requests=2, running_tokens=500)
    eventually(lambda: load(decode) == running, 10, "decode admitted both and waits for their KV")
    stuck.release.set()
    eventually(lambda: all(o.get("state") for o in outs), 30, "every side answered")
    assert all(o["state"] == "SUCCESS" for o in outs), [o.get("reason") for o in outs]
    assert load(prefill) == IDLE and load(decode) == IDLE


def test_a_request_refused_for_a_full_pool_leaves_no_load(pair, eventually):
    """Queued, then refused (the pool stayed full past queue_wait_s): it counts no more."""
    prefill, decode, stuck, run = pair
    prefill.admission.wait_s = 0.2  # (the wait the refusal ends)
    held = run(prefill.prefill, 1, np.arange(300))
    assert stuck.entered.wait(10)
    refused = run(lambda: {"raised": _raised(prefill.prefill, 2, np.arange(50))})
    eventually(lambda: "raised" in refused, 10, "room 2 is refused")
    assert refused["raised"] == "Overloaded", refused
    assert load(prefill) == WorkerLoad(queued_requests=0, queued_tokens=0, running_requests=1, running_tokens=300)
    prefill.abort(1, "test over")
    stuck.release.set()
    eventually(lambda: held.get("state") == "FAILED", 30, "room 1 ends, aborted")
    assert load(prefill) == IDLE


def _raised(fn, *args) -> str:
    try:
        fn(*args)
    except Exception as exc:
        return type(exc).__name__
    return "nothing"
