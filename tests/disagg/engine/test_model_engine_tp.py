"""The model engine on TP shards: N prefill ranks each compute the whole model and write their
shard; their bytes are resharded onto M decode ranks exactly as a transfer cuts rows
(kvpool.shards.reshard, at each side's own page size); every decode rank continues from its
shard and gives the colocated run's tokens and bit-identical logits. A flipped byte in one
rank's shard fails that rank's check and no other's."""

import numpy as np
import pytest
import torch

from disagg.engine import registry
from disagg.engine.model.cache_io import CacheIO
from kvpool import Component, HybridPool, PoolConfig
from kvpool.geometry import parts
from kvpool.positions import backed, kept_positions, token_items
from kvpool.shards import reshard
from tests.disagg.engine.test_model_engine import prompt

ENGINES: dict = {}
FAMILIES = ["tiny-model-gpt-oss", "tiny-model-qwen3-next", "tiny-model-nemotron-h", "tiny-model-deepseek-v32"]
TP_PAIRS = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 4), (4, 1)]
# Mamba2 hybrids whose conv groups are read off their mixers (bamba's rank 0 of 2 once got
# channels 0-79 instead of x 0-63, B 128-135, C 144-151, and the outputs still matched)
MAMBA2 = ["tiny-model-bamba", "tiny-model-granite-hybrid", "tiny-model-falcon-h1"]


def engine(preset: str, device: str):
    if (preset, device) not in ENGINES:
        ENGINES[preset, device] = registry.create("model", preset, device)
    return ENGINES[preset, device]


def pool(eng, device: str, page_size: int, tp: int, rank: int) -> HybridPool:
    return HybridPool(
        PoolConfig(eng.spec, page_size, max_tokens=512, max_requests=4, device=device, tp_size=tp, tp_rank=rank)
    )


def _rows(p: HybridPool, req, c: Component, layer: int, part: str, n: int):
    """(index into the layer view, its rows as bytes [rows, row bytes]) of what `req` keeps."""
    view = p.layer_view(layer, part)
    if c is Component.MAMBA:
        at = (torch.tensor([int(p.index_set(req)[c][0])]),)
    else:
        items, slots = token_items(p, c, req, kept_positions(p, c, n))
        keep = backed(items)
        at = (torch.from_numpy(items[keep].astype(np.int64)), torch.from_numpy(slots[keep].astype(np.int64)))
    return at, view[at].contiguous().view(torch.uint8).reshape(len(at[0]), -1)


def reshard_copy(srcs: list, dst: HybridPool, dreq, n: int) -> None:
    """Every row `dreq` keeps, its bytes cut from the source ranks' rows as the planner cuts them."""
    cfg = dst.config
    for c, component in dst.pools.items():
        if c is Component.AUX:
            continue
        for placement in component.storage.packed.placements:
            layer, part = placement.segment.layer, placement.segment.part
            at, out = _rows(dst, dreq, c, layer, part, n)
            for src, sreq in srcs:
                _, rows = _rows(src, sreq, c, layer, part, n)
                for s, d, length in reshard(
                    parts(cfg.model, c, part), (src.config.tp_size, src.config.tp_rank), (cfg.tp_size, cfg.tp_rank)
                ):
                    out[:, d : d + length] = rows[-len(out) :, s : s + length]  # both keep the last positions
            view = dst.layer_view(layer, part)
            view[at] = out.view(view.dtype).reshape(view[at].shape)
    aux = srcs[0][0].aux.read(srcs[0][1].aux_row)
    dst.aux.write(dreq.aux_row, int(aux["room"]), int(aux["num_tokens"]), int(aux["first_token"]), bytes(aux["digest"]))


def prefill_instance(eng, device: str, tp: int, page_size: int, tokens) -> list:
    ranks = []
    for rank in range(tp):
        p = pool(eng, device, page_size, tp, rank)
        req = p.alloc_request(len(tokens))
        eng.prefill(p, req, tokens, room=5)
        ranks.append((p, req))
    return ranks


@pytest.mark.parametrize(
    "preset,tp",
    [(f, tp) for f in FAMILIES for tp in TP_PAIRS] + [(f, tp) for f in MAMBA2 for tp in ((1, 2), (2, 1))],
    ids=lambda v: f"{v[0]}->{v[1]}" if isinstance(v, tuple) else v,
)
def test_every_decode_rank_continues_from_its_resharded_shard_token_exact(preset, tp, device):
    eng = engine(preset, device)
    n, m = tp
    tokens = prompt(21, eng.vocab_size)  # > the SWA window and the NSA top-k
    prefill = prefill_instance(eng, device, n, 4, tokens)
    outputs = []
    for rank in range(m):
        dst = pool(eng, device, 16 if n < m else 1, m, rank)  # page sizes differ as well
        empty = dst.available()
        dreq = dst.alloc_request(len(tokens), swa_window_only=True)
        reshard_copy(prefill, dst, dreq, len(tokens))
        eng.verify(dst, dreq, tokens, room=5)
        out = eng.decode(dst, dreq, tokens, max_new_tokens=6)
        check = eng.check(tokens, out)
        assert check["token_match"] and check["logits_match"] and check["shard_match"], (rank, check)
        outputs.append(out.tokens)
        dst.free_request(dreq)
        assert dst.available() == empty
    assert all(t == outputs[0] for t in outputs)


# (family, layer, part) whose largest value in rank 1's shard moves the output when flipped
CORRUPTIONS = [
    ("tiny-model-gpt-oss", 1, "k"),
    ("tiny-model-gpt-oss", 1, "v"),
    ("tiny-model-gpt-oss", 0, "k"),
    ("tiny-model-qwen3-next", 0, "conv"),
    ("tiny-model-nemotron-h", 0, "temporal"),
]


@pytest.mark.parametrize("preset,layer,part", CORRUPTIONS)
def test_a_flipped_byte_in_one_ranks_shard_fails_that_ranks_check_only(preset, layer, part, device):
    eng = engine(preset, device)
    tokens = prompt(23, eng.vocab_size)
    prefill = prefill_instance(eng, device, 1, 4, tokens)
    checks = []
    for rank in range(2):
        dst = pool(eng, device, 4, 2, rank)
        dreq = dst.alloc_request(len(tokens), swa_window_only=True)
        reshard_copy(prefill, dst, dreq, len(tokens))
        if rank == 1:  # the last kept position's row / the slot
            kind = eng.spec.layer_kinds()[layer]
            c = Component.MAMBA if part in ("conv", "temporal") else Component.SWA if kind == "swa" else Component.FULL
            at, _ = _rows(dst, dreq, c, layer, part, len(tokens))
            view, last = dst.layer_view(layer, part), tuple(i[-1:] for i in at)
            row = view[last].clone()
            row.view(-1).view(torch.uint8)[4 * int(row.abs().argmax()) + 3] ^= 0x80  # the sign of its largest
            view[last] = row
        checks.append(eng.check(tokens, eng.decode(dst, dreq, tokens, max_new_tokens=6)))
    assert checks[0]["logits_match"] and checks[0]["token_match"], checks[0]
    assert not checks[1]["logits_match"] and checks[1]["max_logit_diff"] > 0, checks[1]


@pytest.mark.parametrize("preset", ["tiny-model-gpt-oss", "tiny-model-qwen3-next"])
def test_decode_steps_write_the_ranks_units_of_each_new_token(preset, device):
    """Rank 1 of 2 decodes 3 steps (each writes its units of the new token and its state);
    its pool then holds exactly its units of the colocated run's cache of prompt + 3 tokens."""
    eng = engine(preset, device)
    tokens = prompt(19, eng.vocab_size)
    dst = pool(eng, device, 4, 2, 1)
    dreq = dst.alloc_request(len(tokens), swa_window_only=True)
    reshard_copy(prefill_instance(eng, device, 1, 4, tokens), dst, dreq, len(tokens))
    out = eng.decode(dst, dreq, tokens, max_new_tokens=4)
    _, want = eng._prompt(tokens)  # the colocated run: prefill's passes
    for t in out.tokens[:3]:
        _, want = eng._forward([t], want)
    got = CacheIO(dst, eng._states).read_cache(dreq, len(tokens) + 3, eng.config, whole=want)
    for layer, kind in enumerate(eng.spec.layer_kinds()):
        a, b = got.layers[layer], want.layers[layer]
        if kind == "linear":  # (the conv state's oldest column is never kept)
            assert torch.equal(a.conv_states[0][..., 1:], b.conv_states[0][..., 1:]), layer
            assert torch.equal(a.recurrent_states[0], b.recurrent_states[0]), layer
        elif kind != "none":
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), layer


def test_a_split_shard_needs_the_prompt_and_a_replicated_one_does_not(device):
    eng = engine("tiny-model-gpt-oss", device)  # K/V heads split across 2 ranks
    tokens = prompt(9, eng.vocab_size)
    p, req = prefill_instance(eng, device, 2, 4, tokens)[1]
    with pytest.raises(ValueError, match="TP shard"):
        eng.generate(p, req, len(tokens), 1, max_new_tokens=2)
    mla = engine("tiny-model-deepseek-v3", device)  # the latent whole on every rank
    tokens = prompt(9, mla.vocab_size)
    p, req = prefill_instance(mla, device, 2, 4, tokens)[1]
    first = int(p.aux.read(req.aux_row)["first_token"])
    out = mla.generate(p, req, len(tokens), first, max_new_tokens=3)
    assert mla.check(tokens, out)["logits_match"]


def test_each_decode_ranks_conv_bytes_are_its_real_shard(device):
    """bamba: conv [x: 4 heads x 32 | B: 2 groups x 8 | C: 2 groups x 8], state [4 heads, 32, 8].
    After TP 1 -> 2, rank r's conv rows are x channels 64r..64r+63, B 128+8r.., C 144+8r..
    of the colocated run's conv state (written out here, not derived by the code under
    test), and its state rows are heads 2r, 2r+1."""
    eng = engine("tiny-model-bamba", device)
    tokens = prompt(13, eng.vocab_size)
    _, whole = eng._prompt(tokens)
    prefill = prefill_instance(eng, device, 1, 4, tokens)
    for rank in range(2):
        dst = pool(eng, device, 4, 2, rank)
        dreq = dst.alloc_request(len(tokens))
        reshard_copy(prefill, dst, dreq, len(tokens))
        slot = int(dst.index_set(dreq)[Component.MAMBA][0])
        channels = [
            *range(64 * rank, 64 * rank + 64),
            *range(128 + 8 * rank, 136 + 8 * rank),
            *range(144 + 8 * rank, 152 + 8 * rank),
        ]
        for layer in eng.spec.linear.layers:
            conv = whole.layers[layer].conv_states[0][0]  # [160 channels, kernel]
            assert torch.equal(dst.layer_view(layer, "conv")[slot], conv[channels, 1:]), (rank, layer)
            state = whole.layers[layer].recurrent_states[0][0]  # [4 heads, 32, 8]
            assert torch.equal(dst.layer_view(layer, "temporal")[slot], state[2 * rank : 2 * rank + 2]), (rank, layer)


def test_the_check_compares_the_bytes_a_rank_holds_not_only_the_outputs(device):
    """A byte the model never reads again (the K of the last token decode wrote) changes no
    output, and the check still finds it: the rank's bytes are not the colocated run's shard."""
    eng = engine("tiny-model-bamba", device)
    tokens = prompt(11, eng.vocab_size)
    dst = pool(eng, device, 4, 2, 1)
    dreq = dst.alloc_request(len(tokens))
    reshard_copy(prefill_instance(eng, device, 1, 4, tokens), dst, dreq, len(tokens))
    out = eng.decode(dst, dreq, tokens, max_new_tokens=4)
    assert eng.check(tokens, out)["shard_match"]
    layer = eng.spec.full.layers[0]
    at, _ = _rows(dst, dreq, Component.FULL, layer, "k", dreq.num_tokens)
    view, last = dst.layer_view(layer, "k"), tuple(i[-1:] for i in at)
    row = view[last].clone()
    row.view(-1).view(torch.uint8)[3] ^= 0x80
    view[last] = row
    check = eng.check(tokens, out)
    assert check["token_match"] and check["logits_match"], check
    assert not check["shard_match"] and check["shard_differences"] == [f"layer {layer} k"], check


def test_tp_is_refused_with_the_reason_where_conv_groups_cannot_be_derived():
    """A mixer of an unknown kind, or one whose numbers do not add up to its conv state: no
    groups, a reason, and a pool of TP > 1 refused with it (TP 1 is fine)."""
    from disagg.engine.model.geometry import conv_groups
    from kvpool import AttentionSpec, LinearStateSpec, ModelSpec
    from kvpool.errors import SpecError

    class Unknown(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1d = torch.nn.Conv1d(24, 24, 4, groups=24)

    odd = Unknown()
    assert "cannot derive" in conv_groups(odd, 3, 24, (4, 8, 8)).refusal
    odd.num_heads, odd.head_dim, odd.n_groups, odd.ssm_state_size = 2, 8, 1, 2  # 16 + 2 + 2 != 24
    refused = conv_groups(odd, 3, 24, (2, 8, 2))
    assert refused.groups is None and "hold 20 channels" in refused.refusal and "layer 3 (Unknown)" in refused.refusal
    odd.ssm_state_size = 4  # 16 + 4 + 4 = 24
    assert conv_groups(odd, 3, 24, (2, 8, 4)).groups == ((2, 8), (1, 4), (1, 4))
    spec = ModelSpec(
        "m",
        2,
        full=AttentionSpec((1,), 2, 8, 8),
        default_page_size=4,
        linear=LinearStateSpec((0,), 24, 3, 2, 8, 4, tp_refusal=refused.refusal),
    )
    PoolConfig(spec, 4, max_tokens=64, max_requests=2)
    with pytest.raises(SpecError, match="TP 2 refused for its linear-state layers: layer 3"):
        PoolConfig(spec, 4, max_tokens=64, max_requests=2, tp_size=2, tp_rank=0)
