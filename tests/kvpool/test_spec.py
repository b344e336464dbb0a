import pytest

from kvpool import (
    AttentionSpec,
    Component,
    LinearStateSpec,
    ModelSpec,
    NSAIndexerSpec,
    PoolConfig,
    SpecError,
    bytes_per_request,
    bytes_per_token,
    get_preset,
)
from kvpool.presets import PRESETS, REAL_PRESETS, TINY_PRESETS

# (preset, component, figure) straight from ../shared/models.md (whole model, TP 1)
MODELS_MD = [
    ("gpt-oss-120b", Component.FULL, 36_864),
    ("gpt-oss-120b", Component.SWA, 36_864),
    ("gpt-oss-20b", Component.FULL, 24_576),
    ("gemma-3-27b", Component.FULL, 81_920),
    ("gemma-3-4b", Component.FULL, 20_480),
    ("mimo-v2-flash", Component.FULL, 9 * 2_560),
    ("mimo-v2-flash", Component.SWA, 39 * 5_120),
    ("qwen3-next-80b-a3b", Component.FULL, 24_576),
    ("nemotron-h-8b", Component.FULL, 16_384),
    ("deepseek-v3.2", Component.FULL, 70_272),
    ("deepseek-v3.2", Component.NSA, 8_052),
    ("llama-3.1-8b", Component.FULL, 131_072),
    ("llama-3.1-70b", Component.FULL, 327_680),
]


@pytest.mark.parametrize("preset,component,expected", MODELS_MD)
def test_bytes_per_token_matches_models_md(preset, component, expected):
    assert bytes_per_token(get_preset(preset), component) == expected


@pytest.mark.parametrize(
    "preset,layers,per_layer",
    [
        ("qwen3-next-80b-a3b", 36, 49_152 + 2_097_152),
        ("nemotron-h-8b", 24, 61_440 + 4_194_304),
    ],
)
def test_state_bytes_per_request_matches_models_md(preset, layers, per_layer):
    assert bytes_per_request(get_preset(preset), Component.MAMBA) == layers * per_layer


def test_layer_patterns():
    assert get_preset("gpt-oss-120b").layer_kinds()[:4] == ("swa", "full", "swa", "full")
    gemma = get_preset("gemma-3-27b").layer_kinds()
    assert [i for i, k in enumerate(gemma) if k == "full"] == list(range(5, 62, 6))
    mimo = get_preset("mimo-v2-flash").layer_kinds()
    assert [i for i, k in enumerate(mimo) if k == "full"] == [0, 5, 11, 17, 23, 29, 35, 41, 47]
    nemo = get_preset("nemotron-h-8b").layer_kinds()
    assert [i for i, k in enumerate(nemo) if k == "full"] == [7, 18, 29, 40]
    assert nemo.count("linear") == 24 and nemo.count("none") == 24
    assert set(get_preset("deepseek-v3.2").layer_kinds()) == {"mla"}


def test_tp_splits_heads_and_replicates_mla():
    gpt = get_preset("gpt-oss-120b")
    assert bytes_per_token(gpt, Component.FULL, tp_size=8) == 36_864 // 8
    ds = get_preset("deepseek-v3.2")
    assert bytes_per_token(ds, Component.FULL, tp_size=8) == 70_272
    assert bytes_per_token(ds, Component.NSA, tp_size=8) == 8_052
    qwen = get_preset("qwen3-next-80b-a3b")
    assert bytes_per_request(qwen, Component.MAMBA, tp_size=2) == bytes_per_request(qwen, Component.MAMBA) // 2


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: AttentionSpec((0,), 2, 8, 8, window=0), "window must be a positive"),
        (lambda: AttentionSpec((0,), 2, 8, 8, window=-4), "window must be a positive"),
        (lambda: AttentionSpec((0,), 0, 8, 8), "kv_heads must be a positive"),
        (lambda: AttentionSpec((), 2, 8, 8), "at least one layer"),
        (lambda: AttentionSpec((0, 0), 2, 8, 8), "duplicate"),
        (lambda: AttentionSpec((0,), 2, 8, 8, dtype="float13"), "unknown dtype"),
        (lambda: NSAIndexerSpec((0,), key_dim=100, scale_block=64), "not a multiple"),
        (lambda: ModelSpec("m", 2, full=AttentionSpec((0, 2), 2, 8, 8)), ">= num_layers"),
        (
            lambda: ModelSpec("m", 2, full=AttentionSpec((0,), 2, 8, 8), swa=AttentionSpec((0,), 2, 8, 8, window=4)),
            "both full and swa",
        ),
        (lambda: ModelSpec("m", 2, full=AttentionSpec((0,), 2, 8, 8), nsa=NSAIndexerSpec((1,))), "non-full"),
        (lambda: ModelSpec("m", 2, swa=AttentionSpec((0,), 2, 8, 8)), "need a window"),
        (lambda: ModelSpec("m", 2, linear=LinearStateSpec((0,), 8, 3, 2, 4, 4)), "attention layers"),
        (lambda: ModelSpec("m", 1, full=AttentionSpec((0,), 2, 8, 8), default_page_size=12), "power of two"),
    ],
)
def test_spec_validation(make, message):
    with pytest.raises(SpecError, match=message):
        make()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(page_size=3, max_tokens=64), "power of two"),
        (dict(page_size=0, max_tokens=64), "power of two"),
        (dict(page_size=4, max_tokens=64, tp_size=3), "neither divisible by nor a divisor of TP size 3"),
        (dict(page_size=4, max_tokens=64, tp_size=2, tp_rank=2), "tp_rank 2 outside"),
        (dict(page_size=4), "exactly one of"),
        (dict(page_size=4, max_tokens=64, byte_budget=1 << 20), "exactly one of"),
        (dict(page_size=4, byte_budget=100), "too small"),
        (dict(page_size=4, max_tokens=2), "no page"),
        (dict(page_size=4, max_tokens=64, swa_ratio=0), "swa_ratio"),
        (dict(page_size=4, max_tokens=64, layout="diagonal"), "diagonal"),
    ],
)
def test_pool_config_validation(kwargs, message):
    with pytest.raises((SpecError, ValueError), match=message):
        PoolConfig(get_preset("tiny-hybrid"), **kwargs)


def test_swa_pool_must_hold_a_window():
    with pytest.raises(SpecError, match="cannot hold one window"):
        PoolConfig(get_preset("gemma-3-27b"), 16, byte_budget=256 << 20, max_requests=2)


def test_byte_budget_is_respected():
    for name in ("tiny-hybrid", "gpt-oss-120b", "qwen3-next-80b-a3b"):
        cfg = PoolConfig(get_preset(name), 16, byte_budget=512 << 20, max_requests=2)
        s = cfg.sizes()
        used = sum(cfg.row_bytes(c) * s.num_items(c) for c in cfg.components)
        assert 0.95 * (512 << 20) < used <= 512 << 20


def test_config_is_frozen():
    cfg = PoolConfig(get_preset("tiny-full"), 4, max_tokens=64)
    with pytest.raises(AttributeError):
        cfg.page_size = 8


def test_every_models_md_row_is_a_preset():
    assert set(REAL_PRESETS) == {p for p, _, _ in MODELS_MD}
    assert len(TINY_PRESETS) >= 4 and set(PRESETS) == set(REAL_PRESETS) | set(TINY_PRESETS)


def test_unknown_preset():
    with pytest.raises(SpecError, match="unknown preset"):
        get_preset("gpt-5")
