"""The digest decode checks what arrived against (kvpool.digest, disagg.control.digests): it
adds up over units and positions, so every decode rank's sums equal the slots its senders
report whatever the two TP sizes and page sizes; one flipped bit anywhere fails the check
naming its component, layer, part and unit; and the records, which come from the network,
are refused with a reason when they are not exactly one per slot the rank holds."""

import msgspec
import numpy as np
import pytest
import torch

from disagg.control import digests
from disagg.control import messages as P
from disagg.engine.standin import StandInEngine
from disagg.errors import ProtocolError, VerifyError
from kvpool import Component, HybridPool, PoolConfig, get_preset
from kvpool import digest
from tests.disagg.engine.test_model_engine_tp import reshard_copy

PRESETS = ["tiny-full", "tiny-swa", "tiny-mla-nsa", "tiny-mamba", "tiny-hybrid"]
PAIRS = [(1, 1, 4, 4), (2, 1, 4, 16), (1, 2, 16, 4), (2, 4, 4, 1), (4, 2, 8, 8)]  # TP and page sizes
TOKENS = np.random.default_rng(1).integers(0, 50000, 53)


def _instance(model, tp: int, page: int, copy_from=None) -> list:
    ranks = []
    for rank in range(tp):
        pool = HybridPool(PoolConfig(model, page, max_tokens=512, max_requests=4, tp_size=tp, tp_rank=rank))
        if copy_from is None:
            req = pool.alloc_request(len(TOKENS))
            StandInEngine().prefill(pool, req, TOKENS, room=1)
        else:
            req = pool.alloc_request(len(TOKENS), swa_window_only=True)
            reshard_copy(copy_from, pool, req, len(TOKENS))
        ranks.append((pool, req))
    return ranks


def _arrival(preset: str, pair: tuple):
    """(model, decode ranks, the wires each decode rank gets: one per prefill rank)."""
    n, m, p_page, d_page = pair
    model = get_preset(preset)
    prefill = _instance(model, n, p_page)
    decode = _instance(model, m, d_page, copy_from=prefill)
    sums = [digest.compute(p, q, len(TOKENS)) for p, q in prefill]
    wires = [[digests.for_destination(model, sums[s], (n, s), (m, d)) for s in range(n)] for d in range(m)]
    return model, decode, wires


def _verify(model, pool, req, wires) -> None:
    tp = (pool.config.tp_size, pool.config.tp_rank)
    digests.check(model, tp, digest.compute(pool, req, len(TOKENS)), digests.expected(model, tp, wires))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: f"TP {p[0]}->{p[1]} pages {p[2]}->{p[3]}")
def test_every_decode_rank_matches_its_senders_and_a_flip_names_its_unit(preset, pair):
    model, decode, wires = _arrival(preset, pair)
    for (pool, req), wire in zip(decode, wires):
        _verify(model, pool, req, wire)
    pool, req = decode[-1]
    c = Component.SWA if Component.SWA in pool.pools else Component.FULL
    layer = digest.layout(model, c)[-1]
    at = (int(req.full_pages[-1] if c is Component.FULL else pool.index_set(req)[c][-1]), 0)
    view = pool.layer_view(layer.layer, layer.part)[at]
    view.reshape(-1).view(torch.uint8)[-1] ^= 1  # the lowest bit of the last unit's last byte
    with pytest.raises(
        VerifyError,
        match=rf"^{c.value} layer {layer.layer} {layer.part} unit \d+: the bytes "
        r"that arrived differ from those prefill wrote \(1 of \d+",
    ):
        _verify(model, pool, req, wires[-1])


def test_a_state_flip_is_caught_at_tp_2_to_1():
    model, decode, wires = _arrival("tiny-mamba", (2, 1, 4, 4))
    pool, req = decode[0]
    item = int(pool.index_set(req)[Component.MAMBA][0])
    pool.layer_view(model.linear.layers[0], "conv")[item].reshape(-1).view(torch.uint8)[0] ^= 0x80
    with pytest.raises(VerifyError, match=r"^mamba layer \d+ conv\[0\] unit 0: "):
        _verify(model, pool, req, wires[0])


@pytest.fixture(scope="module")
def tp1():
    model, decode, wires = _arrival("tiny-hybrid", (2, 1, 4, 4))
    return model, wires[0]


@pytest.mark.parametrize(
    "spoil,says",
    [
        (lambda w: {**w[0], "full": w[0]["full"][:-1]}, "is not whole 12-byte records"),
        (lambda w: {**w[0], "nonsense": b""}, "'nonsense' is not a component of this model"),
        (lambda w: {**w[0], "full": w[0]["full"] + w[1]["full"][:12]}, "reported twice"),
        (lambda w: {**w[0], "full": np.array([(1 << 30, 0)], digests.RECORD).tobytes()}, "is not one this rank holds"),
        (lambda w: {}, "no sender reported"),
    ],
)
def test_malformed_records_are_a_protocol_error_naming_what_is_wrong(tp1, spoil, says):
    model, wires = tp1
    with pytest.raises(ProtocolError, match=says):
        digests.expected(model, (1, 0), [spoil(wires), wires[1]])


def test_a_digest_of_the_wrong_type_is_refused_when_the_frame_is_decoded():
    frame = msgspec.msgpack.encode(
        {"type": "TransferDone", "room": 1, "prefill_epoch": 2, "ok": True, "digest": {"full": 5}}
    )
    with pytest.raises(ProtocolError, match="undecodable frame"):
        P.Decoder(P.ToDecode, "control").decode(frame)
