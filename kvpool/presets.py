"""Model presets: real model geometries (gpt-oss, Gemma 3, MiMo, Qwen3-Next, Nemotron-H,
DeepSeek-V3.2, Llama 3.1; `disagg presets` prints their bytes), plus tiny ones for tests."""

from kvpool.errors import SpecError
from kvpool.spec import AttentionSpec, LinearStateSpec, MLASpec, ModelSpec, NSAIndexerSpec


def _where(n: int, pred) -> tuple[int, ...]:
    return tuple(i for i in range(n) if pred(i))


def _alternating_swa(name: str, n: int) -> ModelSpec:
    """gpt-oss: even layers sliding window (128), odd layers full; 8 KV heads x 64."""
    return ModelSpec(
        name,
        n,
        full=AttentionSpec(_where(n, lambda i: i % 2 == 1), 8, 64, 64),
        swa=AttentionSpec(_where(n, lambda i: i % 2 == 0), 8, 64, 64, window=128),
    )


def _gemma3(name: str, n: int, heads: int, dim: int) -> ModelSpec:
    """Gemma 3: five local (window 1024) layers, then one global."""
    is_global = lambda i: i % 6 == 5  # noqa: E731
    return ModelSpec(
        name,
        n,
        full=AttentionSpec(_where(n, is_global), heads, dim, dim),
        swa=AttentionSpec(_where(n, lambda i: not is_global(i)), heads, dim, dim, window=1024),
    )


def _dense(name: str, n: int) -> ModelSpec:
    return ModelSpec(name, n, full=AttentionSpec(tuple(range(n)), 8, 128, 128))


_NEMOTRON_H_8B = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"  # M mamba2, * attn, - MLP


def _real() -> list[ModelSpec]:
    mimo_full = lambda i: i == 0 or (i + 1) % 6 == 0  # noqa: E731
    qwen_full = lambda i: (i + 1) % 4 == 0  # noqa: E731
    return [
        _alternating_swa("gpt-oss-120b", 36),
        _alternating_swa("gpt-oss-20b", 24),
        _gemma3("gemma-3-27b", 62, 16, 128),
        _gemma3("gemma-3-4b", 34, 4, 256),
        ModelSpec(
            "mimo-v2-flash",
            48,
            full=AttentionSpec(_where(48, mimo_full), 4, 192, 128),
            swa=AttentionSpec(_where(48, lambda i: not mimo_full(i)), 8, 192, 128, window=128),
        ),
        ModelSpec(
            "qwen3-next-80b-a3b",
            48,
            full=AttentionSpec(_where(48, qwen_full), 2, 256, 256),
            linear=LinearStateSpec(
                _where(48, lambda i: not qwen_full(i)),
                conv_dim=8192,
                conv_width=3,
                temporal_heads=32,
                temporal_d1=128,
                temporal_d2=128,
                conv_groups=((16, 128), (16, 128), (32, 128)),
            ),  # q | k | v heads
        ),
        ModelSpec(
            "nemotron-h-8b",
            52,
            full=AttentionSpec(_where(52, lambda i: _NEMOTRON_H_8B[i] == "*"), 8, 128, 128),
            linear=LinearStateSpec(
                _where(52, lambda i: _NEMOTRON_H_8B[i] == "M"),
                conv_dim=10240,
                conv_width=3,
                temporal_heads=128,
                temporal_d1=64,
                temporal_d2=128,
                conv_groups=((128, 64), (8, 128), (8, 128)),
            ),  # x heads | B, C groups
        ),
        ModelSpec(
            "deepseek-v3.2",
            61,
            full=MLASpec(tuple(range(61)), latent_dim=576),
            nsa=NSAIndexerSpec(tuple(range(61))),
            default_page_size=64,
        ),
        _dense("llama-3.1-8b", 32),
        _dense("llama-3.1-70b", 80),
    ]


def _tiny() -> list[ModelSpec]:
    """Tiny presets for tests: every family, a few layers, small dims, page 4."""
    return [
        ModelSpec("tiny-full", 4, full=AttentionSpec((0, 1, 2, 3), 2, 16, 16), default_page_size=4),
        ModelSpec(
            "tiny-swa",
            4,
            full=AttentionSpec((1, 3), 2, 8, 8),
            swa=AttentionSpec((0, 2), 2, 8, 8, window=8),
            default_page_size=4,
        ),
        ModelSpec(
            "tiny-mla-nsa",
            3,
            full=MLASpec((0, 1, 2), latent_dim=36),
            nsa=NSAIndexerSpec((0, 1, 2), key_dim=32, scale_block=32),
            default_page_size=4,
        ),
        ModelSpec(
            "tiny-mamba",
            4,
            full=AttentionSpec((3,), 2, 16, 16),
            linear=LinearStateSpec(
                (0, 1, 2),
                conv_dim=16,
                conv_width=3,
                temporal_heads=4,
                temporal_d1=8,
                temporal_d2=4,
                conv_groups=((4, 2), (2, 2), (2, 2)),
            ),
            default_page_size=4,
        ),
        ModelSpec(
            "tiny-hybrid",
            6,
            full=AttentionSpec((2, 5), 2, 12, 8),
            swa=AttentionSpec((0, 3), 4, 8, 8, window=6),
            nsa=NSAIndexerSpec((2, 5), key_dim=32, scale_block=32),
            linear=LinearStateSpec(
                (1, 4),
                conv_dim=8,
                conv_width=3,
                temporal_heads=2,
                temporal_d1=4,
                temporal_d2=4,
                conv_groups=((2, 2), (2, 1), (2, 1)),
            ),
            default_page_size=4,
        ),
    ]


PRESETS: dict[str, ModelSpec] = {p.name: p for p in (*_real(), *_tiny())}
TINY_PRESETS = tuple(name for name in PRESETS if name.startswith("tiny-"))
REAL_PRESETS = tuple(name for name in PRESETS if not name.startswith("tiny-"))


def get_preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}") from None
