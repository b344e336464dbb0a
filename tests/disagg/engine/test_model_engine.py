"""The model engine (transformers model code, seeded random weights): KV written into one pool
by prefill, copied byte for byte into another as a transfer would, continued there by decode,
gives the colocated run's tokens and bit-identical logits, for every family. And the check
can fail: one corrupted byte of any component kind shows."""

import numpy as np
import pytest
import torch

from disagg.engine import registry
from disagg.engine.model.engine import TransformersEngine
from disagg.engine.model.families import _ATTN, FAMILIES, Family
from disagg.errors import ConfigError
from kvpool import Component, HybridPool, Layout, PoolConfig
from kvpool.positions import token_items
from tests.kvpool.helpers import copy_request

ENGINES: dict = {}
TINY = [f for f in FAMILIES if f.startswith("tiny-")]
REAL_SIZE = [f for f in FAMILIES if not f.startswith("tiny-")]  # bf16, GB of weights: GPU suite
LENGTHS = (1, 5, 7, 8, 9, 23, 40)  # window 8: shorter, equal, one past, several windows


def engine(preset: str, device: str):
    """One engine per family and device for the module (building one takes ~0.3 s)."""
    if (preset, device) not in ENGINES:
        ENGINES[preset, device] = registry.create("model", preset, device)
    return ENGINES[preset, device]


def pools(eng, device, page_size, layout=Layout.PAGE_MAJOR):
    make = lambda: HybridPool(
        PoolConfig(
            eng.spec,
            page_size,
            max_tokens=1024,
            max_requests=8,  # noqa: E731
            layout=layout,
            device=device,
        )
    )
    prefill, decode = make(), make()
    np.random.default_rng(0).shuffle(prefill.pages._stack[: prefill.pages.num_free])  # pages out of order
    return prefill, decode


def prompt(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed + n).integers(0, vocab, n)


def transfer(eng, prefill, decode, tokens, room=7):
    """Prefill in one pool, copy into the other (decode keeps the SWA window only)."""
    preq = prefill.alloc_request(len(tokens))
    layers = []
    eng.prefill(prefill, preq, tokens, room, on_layer=layers.append)
    assert layers == list(range(eng.spec.num_layers))
    dreq = decode.alloc_request(len(tokens), swa_window_only=True)
    copy_request(prefill, preq, decode, dreq)
    prefill.free_request(preq)
    eng.verify(decode, dreq, tokens, room)
    return dreq


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("preset", TINY + [pytest.param(f, marks=pytest.mark.gpu) for f in REAL_SIZE])
def test_disaggregated_equals_colocated(preset, page_size, device):
    eng = engine(preset, device)
    prefill, decode = pools(eng, device, page_size)
    empty = decode.available(), prefill.available()
    for n in LENGTHS:
        tokens = prompt(n, eng.vocab_size)
        dreq = transfer(eng, prefill, decode, tokens)
        out = eng.decode(decode, dreq, tokens, max_new_tokens=10)
        check = eng.check(tokens, out)
        assert check["token_match"] and check["logits_match"] and check["shard_match"], (n, check)
        assert len(out.tokens) == 10 and dreq.num_tokens == n + 9
        decode.free_request(dreq)
    assert (decode.available(), prefill.available()) == empty
    decode.check_integrity()


@pytest.mark.parametrize("layout", list(Layout))
def test_both_layouts(layout, device):
    eng = engine("tiny-model-gpt-oss", device)
    prefill, decode = pools(eng, device, 4, layout)
    tokens = prompt(30, eng.vocab_size)
    out = eng.decode(decode, transfer(eng, prefill, decode, tokens), tokens, max_new_tokens=12)
    assert eng.check(tokens, out)["logits_match"]


# (family, layer, part): one of each component kind the pools carry, each at a layer whose
# value there demonstrably moves the output (with init range 0.5 attention is nearly hard and
# some heads are gated off, so a flipped value the model gives ~0 weight rightly changes
# nothing, e.g. qwen3-next layer 0's largest recurrent value)
CORRUPTIONS = [
    ("tiny-model-gpt-oss", 1, "k"),
    ("tiny-model-gpt-oss", 0, "k"),
    ("tiny-model-mimo", 1, "k"),
    ("tiny-model-qwen3-next", 0, "conv"),
    ("tiny-model-qwen3-next", 2, "temporal"),
    ("tiny-model-nemotron-h", 0, "conv"),
    ("tiny-model-nemotron-h", 0, "temporal"),
    ("tiny-model-jamba", 0, "temporal"),
    ("tiny-model-falcon-h1", 0, "temporal"),
    ("tiny-model-falcon-h1", 1, "k"),
    ("tiny-model-deepseek-v3", 0, "latent"),
    ("tiny-model-deepseek-v32", 0, "key"),
]


@pytest.mark.parametrize("preset,layer,part", CORRUPTIONS)
def test_one_corrupted_byte_fails_the_check(preset, layer, part, device):
    """Flip the sign bit (one byte) of the largest float of one row that decode reads: the
    last prompt token's row for per-token parts, the request's slot for state."""
    eng = engine(preset, device)
    prefill, decode = pools(eng, device, 4)
    tokens = prompt(23, eng.vocab_size)  # > the NSA top-k (8): the keys choose
    dreq = transfer(eng, prefill, decode, tokens)
    kind = eng.spec.layer_kinds()[layer]
    view = decode.layer_view(layer, part)
    if part in ("conv", "temporal"):
        row = view[int(decode.index_set(dreq)[Component.MAMBA][0])]
    else:
        c = {"swa": Component.SWA, "full": Component.FULL}.get(kind, Component.NSA if part == "key" else Component.FULL)
        items, slots = token_items(decode, c, dreq, np.array([len(tokens) - 1]))
        row = view[int(items[0]), int(slots[0])]
    assert row.dtype == torch.float32 and row.is_contiguous()
    element = int(row.abs().argmax())
    row.view(-1).view(torch.uint8)[4 * element + 3] ^= 0x80
    check = eng.check(tokens, eng.decode(decode, dreq, tokens, max_new_tokens=6))
    assert not check["logits_match"] and check["max_logit_diff"] > 0, check


@pytest.mark.parametrize("preset", ["tiny-model-gpt-oss", "tiny-model-qwen3-next", "tiny-model-deepseek-v32"])
def test_generation_continues_after_retract_and_restore(preset, device):
    """Decode 5 tokens, retract the request to CPU, restore it at other pages, decode on."""
    eng = engine(preset, device)
    prefill, decode = pools(eng, device, 4)
    empty = decode.available()
    tokens = prompt(19, eng.vocab_size)
    dreq = transfer(eng, prefill, decode, tokens)
    first = eng.decode(decode, dreq, tokens, max_new_tokens=5)
    copy = decode.retract(dreq)
    other = decode.alloc_request(33)  # takes the pages the request had
    again = decode.restore(copy)
    assert not np.array_equal(again.full_pages, dreq.full_pages)
    rest = eng.generate(decode, again, again.num_tokens, first.tokens[-1], max_new_tokens=8)
    whole = type(first)(first.tokens + rest.tokens[1:], first.logits + rest.logits)
    check = eng.check(tokens, whole)
    assert check["token_match"] and check["logits_match"], check
    decode.free_request(again)
    decode.free_request(other)
    assert decode.available() == empty


def test_layer_progress_reports_each_layer_once_its_bytes_are_final(device):
    """on_layer(i) comes after layer i's pool bytes are final and before layer i+1's are (of
    the prompt's last prefill pass: the last page; the passes before wrote the first pages of
    every layer already)."""
    eng = engine("tiny-model-deepseek-v3", device)  # every layer MLA: one part to look at
    prefill, _ = pools(eng, device, 4)
    tokens = prompt(12, eng.vocab_size)
    req = prefill.alloc_request(len(tokens))
    item, last = int(req.full_pages[-1]), eng.spec.num_layers - 1
    seen = []
    latent = lambda i: prefill.layer_view(min(i, last), "latent")[item].clone()  # noqa: E731 (last page)
    eng.prefill(prefill, req, tokens, 3, on_layer=lambda i: seen.append((i, latent(i), latent(i + 1))))
    assert [i for i, *_ in seen] == list(range(last + 1))
    for i, at_report, next_at_report in seen:
        assert torch.equal(at_report, latent(i))
        if i < last:
            assert not torch.equal(next_at_report, latent(i + 1))


def test_geometry_is_the_models_and_mismatches_are_refused(device, monkeypatch):
    eng = engine("tiny-model-mimo", device)
    spec = eng.spec
    assert spec.full.k_dim != spec.full.v_dim and spec.swa.kv_heads == 2 * spec.full.kv_heads
    assert spec.swa.window == eng.config.sliding_window
    other = engine("tiny-model-gpt-oss", device)
    with pytest.raises(ConfigError, match="tiny-model-gpt-oss"):
        eng.check_pool(pools(other, device, 4)[0])
    with pytest.raises(ConfigError, match="geometry only"):
        registry.create("model", "tiny-hybrid", device)
    falcon = engine("tiny-model-falcon-h1", device)  # K/V and a Mamba2 state in every layer: in both
    assert falcon.spec.full.layers == falcon.spec.linear.layers == (0, 1)
    assert falcon.spec.layer_kinds() == ("full", "full")


@pytest.mark.parametrize("preset", [f for f in TINY if FAMILIES[f].chunked_attention])
def test_chunked_attention_is_the_families_eager_attention_on_blocks_of_queries(preset, device):
    """Prompts longer than the block run the family's own eager attention block by block (a
    32k prompt's scores would need 128 GiB at once): the logits are eager's up to float
    rounding, and disaggregated still equals colocated with the chunked engine."""
    whole = engine(preset, device)
    chunked = TransformersEngine(preset, device, attn_chunk=5)
    tokens = prompt(37, whole.vocab_size)  # 8 blocks, the last one short
    want, _ = whole._forward(tokens, whole._cache())
    got, _ = chunked._forward(tokens, chunked._cache())
    assert not torch.equal(want, torch.zeros_like(want))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    prefill, decode = pools(chunked, device, 4)
    dreq = transfer(chunked, prefill, decode, tokens)
    check = chunked.check(tokens, chunked.decode(decode, dreq, tokens, max_new_tokens=6))
    assert check["token_match"] and check["logits_match"], check


# families whose cache layers the pool cannot hold: refused when the engine is built, in one
# line that says what the layer keeps (once an AttributeError on a None state)
REFUSED = [
    ("mamba2", dict(num_hidden_layers=2, num_heads=4, head_dim=32, n_groups=2, state_size=8), "filled no state"),
    ("falcon_mamba", dict(num_hidden_layers=2, state_size=8), "filled no state"),
    ("lfm2", dict(**_ATTN, num_hidden_layers=2, layer_types=["conv", "full_attention"]), "conv state and no recurrent"),
]


@pytest.mark.parametrize("model_type,config,words", REFUSED, ids=[r[0] for r in REFUSED])
def test_families_the_pool_cannot_hold_are_refused_in_one_line(model_type, config, words, monkeypatch):
    monkeypatch.setitem(FAMILIES, "tiny-x", Family("tiny-x", model_type, config))
    with pytest.raises(ConfigError, match=words) as exc:
        registry.create("model", "tiny-x", "cpu")
    assert "\n" not in str(exc.value) and "layer 0" in str(exc.value)


def test_a_layer_with_several_states_is_refused_not_half_carried():
    from transformers.cache_utils import LinearAttentionLayer

    from disagg.engine.model.geometry import _states

    layer = LinearAttentionLayer(number_of_states=2)
    for i in range(2):
        layer.update_conv_state(torch.zeros(1, 8, 4), state_idx=i)
        layer.update_recurrent_state(torch.zeros(1, 2, 4, 4), state_idx=i)
    with pytest.raises(ConfigError, match="layer 5 .* keeps 2 conv/recurrent states per layer"):
        _states("m", 5, layer)


# model types with no family entry of ours, from their config alone (--model-type/--model-config)
FROM_CONFIG = [
    (
        "olmo_hybrid",
        dict(
            **_ATTN,
            hidden_size=64,
            intermediate_size=128,
            vocab_size=512,
            num_hidden_layers=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            initializer_range=0.5,
            pad_token_id=None,
            eos_token_id=None,
        ),
    ),
]


@pytest.mark.parametrize("model_type,config", FROM_CONFIG, ids=[f[0] for f in FROM_CONFIG])
def test_a_model_type_from_its_config_alone_runs_exact(model_type, config, device):
    import json

    from disagg.engine.model.source import ModelSource

    eng = registry.create(
        "auto", "unused", device, source=ModelSource(model_type=model_type, config_json=json.dumps(config), page_size=4)
    )
    assert eng.spec.linear.conv_groups == ((2, 8), (2, 8), (4, 8)) and eng.identity["weights"].startswith("sha256:")
    prefill, decode = pools(eng, device, 4)
    tokens = prompt(13, eng.vocab_size)
    dreq = transfer(eng, prefill, decode, tokens)
    check = eng.check(tokens, eng.decode(decode, dreq, tokens, max_new_tokens=5))
    assert check["token_match"] and check["logits_match"] and check["shard_match"], check


@pytest.mark.parametrize("found", ["5.17.0", "5.24.1", "6.0.0.dev0", "5.x"])
def test_another_transformers_minor_is_refused_naming_both(found):
    from disagg.engine.model.families import TESTED_TRANSFORMERS, check_transformers

    want = ".".join(map(str, TESTED_TRANSFORMERS))
    with pytest.raises(ConfigError, match=rf"tested with transformers {want}\.x and this environment has {found}"):
        check_transformers(found)
    check_transformers(f"{want}.0")
    check_transformers(f"{want}.7rc1")


def test_the_installed_transformers_is_the_tested_minor():
    """The suite runs what pyproject's `model` extra pins: the engine starts (this would raise)."""
    from disagg.engine.model.families import check_transformers

    check_transformers()
