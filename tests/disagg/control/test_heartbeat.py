"""Dead-peer detection: a prefill that goes silent fails exactly its requests on decode within
the bound; their pages stay quarantined (the peer may only be frozen) until the cap."""

import threading
import time

import numpy as np
import pytest

from disagg.decode.server import DecodeConfig, DecodeServer
from disagg.worker.pool_settings import PoolSettings
from disagg.prefill.server import PrefillConfig, PrefillServer

pytestmark = pytest.mark.slow


def test_silent_prefill_fails_its_requests_within_the_bound(eventually, StuckEngine):
    pool = PoolSettings(preset="tiny-hybrid", max_tokens=2048, max_requests=4, device="cpu")
    stuck = StuckEngine()
    prefill = PrefillServer(PrefillConfig(pool=pool, bootstrap_bind="tcp://127.0.0.1:*"), stuck)
    decode = DecodeServer(
        DecodeConfig(
            pool=pool,
            bootstrap_addr=prefill.bootstrap_endpoint,
            heartbeat_interval_s=0.2,
            dead_after_s=1.5,
            quarantine_s=2.0,
        )
    )
    initial = decode.available()
    tokens = np.arange(100)
    prefill_thread = threading.Thread(target=prefill.prefill, args=(7, tokens), daemon=True)
    result: dict = {}
    decode_thread = threading.Thread(target=lambda: result.update(decode.decode(7, tokens, 2)))
    try:
        prefill_thread.start()
        assert stuck.entered.wait(10)
        decode_thread.start()
        eventually(
            lambda: (r := prefill.requests.get(7)) is not None and r.dests, 10, "prefill holds decode's TransferRequest"
        )
        t0 = time.monotonic()
        prefill._stop.set()  # the prefill's control plane goes silent (no replies, no heartbeats)
        prefill._loop_thread.join()
        decode_thread.join(30)
        elapsed = time.monotonic() - t0
        assert result["state"] == "FAILED" and "silent" in result["reason"], result
        assert elapsed < 1.5 + 0.2 + 2.0, elapsed  # dead_after + one beat + margin
        assert decode.quarantined() == 1  # a frozen prefill might still write: pages are held
        eventually(lambda: decode.available() == initial, 10, "quarantine released after the cap")
        assert decode.quarantined() == 0
    finally:
        stuck.release.set()
        prefill_thread.join(30)
        decode_thread.join(30)
        prefill.close()
        decode.close()


def test_a_duplicate_room_is_refused_and_leaves_the_live_request_alone(eventually, StuckEngine):
    pool = PoolSettings(preset="tiny-full", max_tokens=2048, max_requests=4, device="cpu")
    stuck = StuckEngine()
    prefill = PrefillServer(PrefillConfig(pool=pool, bootstrap_bind="tcp://127.0.0.1:*"), stuck)
    decode = DecodeServer(DecodeConfig(pool=pool, bootstrap_addr=prefill.bootstrap_endpoint))
    initial = decode.available()
    tokens = np.arange(64)
    first: dict = {}
    prefill_thread = threading.Thread(target=prefill.prefill, args=(9, tokens), daemon=True)
    decode_thread = threading.Thread(target=lambda: first.update(decode.decode(9, tokens, 2)))
    try:
        prefill_thread.start()
        assert stuck.entered.wait(10)
        decode_thread.start()
        eventually(lambda: decode.requests.get(9) is not None, 10, "the first request is live on decode")
        second = decode.decode(9, tokens, 2)
        assert second["state"] == "FAILED" and "duplicate room 9" in second["reason"]
        assert decode.requests.get(9) is not None  # the live one is still there
        stuck.release.set()
        decode_thread.join(30)
        assert first["state"] == "SUCCESS" and first["verified"]
        assert decode.available() == initial and decode.quarantined() == 0
    finally:
        stuck.release.set()
        prefill_thread.join(30)
        decode_thread.join(30)
        prefill.close()
        decode.close()
