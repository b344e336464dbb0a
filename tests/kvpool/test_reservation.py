"""A request admitted with grow_to (decode: prompt + new tokens) has what it will need by then
reserved: nobody else may take it, so its own growth never runs short (issue 35, item 12)."""

import pytest

from kvpool import HybridPool, OutOfSpace, PoolConfig, get_preset


def _pool(preset: str, device: str) -> HybridPool:
    return HybridPool(PoolConfig(get_preset(preset), 4, max_tokens=64, max_requests=4, device=device))


def test_the_growth_is_reserved_and_others_cannot_take_it(device):
    pool = _pool("tiny-full", device)
    empty = pool.available()["full_tokens"]
    req = pool.alloc_request(10, grow_to=40)  # 3 pages now, 10 by its last token
    assert pool.available()["full_tokens"] == empty - 40
    with pytest.raises(OutOfSpace):
        pool.alloc_request(25)  # fits in what is free, not beside the reservation
    other = pool.alloc_request(24)
    for n in range(11, 41):  # its own growth never runs short
        pool.extend(req, n)
    assert pool.available()["full_tokens"] == 0
    pool.free_request(req)
    pool.free_request(other)
    assert pool.available()["full_tokens"] == empty
    pool.check_integrity()


def test_what_never_fits_is_known_up_front_and_grow_to_is_checked(device):
    pool = _pool("tiny-full", device)
    assert pool.fits_when_empty(10, grow_to=64) and not pool.fits_when_empty(10, grow_to=65)
    with pytest.raises(OutOfSpace):
        pool.alloc_request(10, grow_to=65)
    with pytest.raises(Exception, match="grow_to must be an int >= the request's 10 tokens"):
        pool.alloc_request(10, grow_to=9)


def test_a_window_only_request_reserves_the_windows_worth_of_swa_pages(device):
    """tiny-swa: window 8, pages of 4. Growing from 10 to 60 tokens, a decode request holds at
    most 3 SWA pages at any time (evicting as it goes): that is what it reserves, not 15."""
    pool = _pool("tiny-swa", device)
    empty = pool.available()
    req = pool.alloc_request(10, swa_window_only=True, grow_to=60)
    held = empty["swa_tokens"] - pool.available()["swa_tokens"]
    assert held == 3 * 4, pool.available()
    for n in range(11, 61):
        pool.extend(req, n)
        assert empty["swa_tokens"] - pool.available()["swa_tokens"] == held, n
    pool.free_request(req)
    assert pool.available() == empty
    pool.check_integrity()
