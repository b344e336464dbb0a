"""The stand-in engine: prefill's KV verifies after a byte-exact copy and fails after any
corruption, for every family."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.engine.standin import StandInEngine, VerifyError
from kvpool import Component, HybridPool, PoolConfig, get_preset
from tests.kvpool.helpers import copy_request


@pytest.mark.parametrize("preset", ["tiny-full", "tiny-swa", "tiny-mla-nsa", "tiny-mamba", "tiny-hybrid"])
def test_prefill_then_copy_verifies_and_corruption_is_caught(preset, device):
    model = get_preset(preset)
    prefill = HybridPool(PoolConfig(model, 4, max_tokens=512, max_requests=4, device=device))
    decode = HybridPool(PoolConfig(model, 4, max_tokens=512, max_requests=4, device=device))
    np.random.default_rng(0).shuffle(prefill.pages._stack[: prefill.pages.num_free])
    standin = StandInEngine()
    tokens = np.random.default_rng(1).integers(0, 50000, 53)
    preq = prefill.alloc_request(len(tokens))
    result = standin.prefill(prefill, preq, tokens, room=77)
    dreq = decode.alloc_request(len(tokens), swa_window_only=True)
    copy_request(prefill, preq, decode, dreq)
    standin.verify(decode, dreq, tokens, room=77)
    with pytest.raises(VerifyError, match="room"):
        standin.verify(decode, dreq, tokens, room=78)
    with pytest.raises(VerifyError):
        standin.verify(decode, dreq, tokens[::-1].copy(), room=77)
    # flip one byte of one token of the full component
    view = decode.layer_view(model.full.layers[-1], "latent" if preset == "tiny-mla-nsa" else "v")
    page = int(dreq.full_pages[3])
    view[page].view(torch.uint8).reshape(-1)[5] ^= 1
    with pytest.raises(VerifyError, match="full layer"):
        standin.verify(decode, dreq, tokens, room=77)
    view[page].view(torch.uint8).reshape(-1)[5] ^= 1
    standin.verify(decode, dreq, tokens, room=77)
    new = standin.decode(decode, dreq, tokens, max_new_tokens=9).tokens
    assert len(new) == 9 and new[0] == result.first_token and dreq.num_tokens == len(tokens) + 8
    decode.check_integrity()


def test_fill_and_its_digest_are_deterministic_across_pools_and_layouts():
    from kvpool import Layout, digest

    tokens = np.arange(100, 140)
    digests = []
    for layout in Layout:
        a = HybridPool(PoolConfig(get_preset("tiny-hybrid"), 4, max_tokens=256, max_requests=2, layout=layout))
        req = a.alloc_request(len(tokens))
        StandInEngine().prefill(a, req, tokens, room=1)
        StandInEngine().verify(a, req, tokens, room=1)
        digests.append(digest.compute(a, req, len(tokens)))
    assert digests[0].keys() == digests[1].keys() == {c for c in a.pools if c is not Component.AUX}
    assert all(np.array_equal(digests[0][c], digests[1][c]) for c in digests[0])


@given(
    tokens=st.lists(st.integers(0, (1 << 31) - 1), min_size=1, max_size=40),
    layer=st.integers(0, 200),
    nbytes=st.integers(1, 70),
)
@settings(max_examples=100, deadline=None)
def test_device_arithmetic_matches_the_numpy_reference(tokens, layer, nbytes):
    """The stand-in fills and checks KV with torch on the pool's device; its 64-bit wrapping
    arithmetic and logical shifts must give numpy's uint64 bytes exactly."""
    from disagg.engine.standin import _bytes_for, _bytes_for_t, _mix, _mix_t

    ids = np.asarray(tokens, dtype=np.int64)
    pos = np.arange(len(ids), dtype=np.int64)
    want = _bytes_for(_mix(ids.astype(np.uint64), pos, layer, 0x9E3779B1), nbytes)
    got = _bytes_for_t(_mix_t(torch.from_numpy(ids), torch.from_numpy(pos), layer, 0x9E3779B1), nbytes)
    assert np.array_equal(got.numpy(), want)
