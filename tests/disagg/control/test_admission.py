"""Admission: a full pool means a bounded wait, then a clear refusal; never a deadlock."""

import threading

import pytest

from disagg.control.admission import Admission, TooLarge
from kvpool import HybridPool, PoolConfig, get_preset
from disagg.errors import Overloaded


@pytest.fixture
def pool():
    return HybridPool(PoolConfig(get_preset("tiny-full"), 16, max_tokens=256, max_requests=8, device="cpu"))


def test_a_waiting_request_gets_the_space_another_frees(pool):
    adm = Admission(pool.shortfall, max_waiting=4, wait_s=30)
    held = adm.admit(256, lambda: pool.alloc_request(256))
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(adm.admit(100, lambda: pool.alloc_request(100))))
    waiter.start()
    with adm._freed:  # the waiter is parked on the condition before we free
        assert adm._freed.wait_for(lambda: adm.waiting == 1, 10)
    pool.free_request(held)
    adm.released()
    waiter.join(10)
    assert len(got) == 1 and pool.available()["full_tokens"] == 256 - 112
    assert adm.waiting == 0


def test_the_wait_is_bounded_and_the_refusal_says_why(pool):
    adm = Admission(pool.shortfall, max_waiting=4, wait_s=0.05)
    adm.admit(256, lambda: pool.alloc_request(256))
    with pytest.raises(Overloaded, match="pool full for 0.05 s: full.*need"):
        adm.admit(16, lambda: pool.alloc_request(16))
    assert adm.waiting == 0 and pool.available()["full_tokens"] == 0


def test_more_waiters_than_allowed_are_refused_at_once(pool):
    adm = Admission(pool.shortfall, max_waiting=0, wait_s=30)
    adm.admit(256, lambda: pool.alloc_request(256))
    with pytest.raises(Overloaded, match="0 requests already waiting"):
        adm.admit(16, lambda: pool.alloc_request(16))


def test_a_request_larger_than_the_empty_pool_is_refused_without_waiting(pool):
    adm = Admission(pool.shortfall, max_waiting=4, wait_s=30)
    with pytest.raises(TooLarge, match="300 tokens does not fit"):
        adm.admit(300, lambda: pool.alloc_request(300))
    assert pool.available()["full_tokens"] == 256


def test_a_caller_deadline_shortens_the_wait(pool):
    import time

    adm = Admission(pool.shortfall, max_waiting=4, wait_s=30)
    adm.admit(256, lambda: pool.alloc_request(256))
    with pytest.raises(Overloaded):
        adm.admit(16, lambda: pool.alloc_request(16), deadline=time.monotonic() + 0.05)


def test_the_pool_says_what_could_ever_fit():
    """Admission asks the pool (which knows its components), never lists them itself."""
    swa = HybridPool(PoolConfig(get_preset("tiny-swa"), 4, max_tokens=256, max_requests=2, swa_ratio=0.25))
    assert swa.fits_when_empty(256) is False  # every SWA page of 256 tokens: too many
    assert swa.fits_when_empty(256, swa_window_only=True)  # the window only: fits
    assert swa.fits_when_empty(64) and not swa.fits_when_empty(257, swa_window_only=True)


def test_a_prefill_swa_pool_holds_what_its_full_pool_does_and_a_refusal_names_the_short_part():
    """Issue 35, item 13: the SWA share was a fixed 0.5, so a gpt-oss prefill with --max-tokens
    256 refused a 129-token prompt "even when empty", with no word of the SWA pool."""
    from disagg.worker.pool_settings import PoolSettings

    settings = PoolSettings(preset="gpt-oss-120b", max_tokens=256, max_requests=4, device="cpu")
    prefill = HybridPool(settings.pool_config(swa_window_only=False))
    decode = HybridPool(settings.pool_config(swa_window_only=True))
    assert prefill.shortfall(129) is None and prefill.shortfall(256) is None  # before: swa pages short
    assert decode.shortfall(256, swa_window_only=True) is None
    assert prefill.shortfall(300).startswith("the full pages hold")
    adm = Admission(prefill.shortfall, max_waiting=4, wait_s=1)
    with pytest.raises(
        TooLarge,
        match="300 tokens does not fit in this pool: the full pages hold 16 .256 tokens. "
        "even when empty; this request needs 19",
    ):
        adm.admit(300, lambda: None)
    tight = HybridPool(
        PoolSettings(preset="gpt-oss-120b", max_tokens=256, max_requests=4, device="cpu", swa_share=0.5).pool_config()
    )
    assert "swa pages hold" in tight.shortfall(200)  # --swa-share 0.5 on a prefill: the SWA part is named
