"""The model families the model engine runs: for each, a HuggingFace model type and a tiny
configuration (a few layers, hidden 64, vocabulary 512) that keeps every state kind of the
family. Weights are random from a seed, so both sides build the same model with no download.

    preset                    HF model type   what its cache holds per layer
    tiny-model-gpt-oss        gpt_oss         full K/V | SWA K/V (window 8), alternating
    tiny-model-gemma3         gemma3_text     five SWA layers, then one full
    tiny-model-mimo           mimo_v2_flash   K dim != V dim; SWA layers have 2x the KV heads
    tiny-model-qwen3-next     qwen3_next      gated-delta-net conv + recurrent state | full K/V
    tiny-model-nemotron-h     nemotron_h      Mamba2 conv + SSM | full K/V | MLP/MoE (none)
    tiny-model-jamba          jamba           Mamba1 conv + SSM | full K/V
    tiny-model-bamba          bamba           Mamba2 conv + SSM (2 groups) | full K/V
    tiny-model-granite-hybrid granitemoehybrid Mamba2 conv + SSM (2 groups) | full K/V, MoE
    tiny-model-falcon-h1      falcon_h1       full K/V and Mamba2 conv + SSM side by side in every layer
    tiny-model-deepseek-v3    deepseek_v3     MLA: latent (32) + rope key (8)
    tiny-model-deepseek-v32   deepseek_v32    MLA + NSA indexer keys (16)

    model-gpt-oss-120b        gpt_oss         gpt-oss-120b's KV geometry, 4 layers, bf16 (GPU)
    model-qwen3-next-80b      qwen3_next      Qwen3-Next-80B's GDN + full geometry, 4 layers, bf16 (GPU)
    model-deepseek-v32        deepseek_v32    DeepSeek-V3.2's MLA + NSA geometry, 3 layers, bf16 (GPU)

The tiny models' init range is 0.5, not the usual 0.02: at 0.02 a corrupted Mamba state moves
the logits by ~1e-6 and the token-match check could not see it (docs/contract.md, "Figures
behind the defaults").
"""

import os
from dataclasses import dataclass, field

from disagg.errors import ConfigError

# No hub access at run time, ever: every model is built from a config in this file.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "TRANSFORMERS_VERBOSITY": "error",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
}

_BASE = dict(
    hidden_size=64,
    intermediate_size=128,
    vocab_size=512,
    initializer_range=0.5,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
_REAL = dict(vocab_size=32000, initializer_range=0.02)  # real-size: the usual init (0.5 would overflow)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# Mamba2 of 4 heads x 32 and 2 groups of d_state 8: conv [x 128 | B 16 | C 16], so a TP split
# by channel instead of by group shows (rank 0 of 2: x 0-63, B 128-135, C 144-151)
_MAMBA2 = dict(mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16)
_MLA = dict(
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
)


@dataclass(frozen=True)
class Family:
    preset: str
    model_type: str  # transformers' name for the architecture
    config: dict = field(compare=False)
    page_size: int = 4
    dtype: str = "float32"  # weights, activations and so the KV the pools hold
    # query-chunked eager attention (engine/model/attention.py); False where the model code
    # branches on the implementation's name (DeepSeek-V3.2 applies its NSA top-k mask only
    # under "eager"/"sdpa": under another name the indexer keys would stop mattering)
    chunked_attention: bool = True
    tiny: bool = True  # the config goes over _BASE (hidden 64, vocabulary 512, init 0.5)
    # tokens per prefill pass (engine/model/reuse.py): whole chunks' KV is the same bits in any
    # longer prompt, so decode may reuse it; 0: one pass (the real-size families' GPU timings)
    prefill_chunk: int = 8

    @property
    def vocab_size(self) -> int:
        return self.config.get("vocab_size", _BASE["vocab_size"])


FAMILIES: dict[str, Family] = {
    f.preset: f
    for f in (
        Family(
            "tiny-model-gpt-oss",
            "gpt_oss",
            dict(
                **_ATTN,
                num_hidden_layers=4,
                sliding_window=8,
                num_local_experts=4,
                num_experts_per_tok=2,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
        ),
        Family("tiny-model-gemma3", "gemma3_text", dict(**_ATTN, num_hidden_layers=6, sliding_window=8)),
        Family(
            "tiny-model-mimo",
            "mimo_v2_flash",
            dict(
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=24,
                v_head_dim=16,
                num_hidden_layers=4,
                sliding_window=8,
                moe_intermediate_size=32,
                n_routed_experts=4,
                num_experts_per_tok=2,
                layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
                mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            ),
        ),
        Family(
            "tiny-model-qwen3-next",
            "qwen3_next",
            dict(
                **_ATTN,
                num_hidden_layers=4,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                linear_num_key_heads=2,
                linear_num_value_heads=4,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
            ),
        ),
        Family(
            "tiny-model-nemotron-h",
            "nemotron_h",
            dict(
                **_ATTN,
                layers_block_type=[
                    "linear_attention",
                    "moe",
                    "full_attention",
                    "mlp",
                    "linear_attention",
                    "full_attention",
                ],
                ssm_state_size=8,
                mamba_num_heads=4,
                mamba_head_dim=8,
                n_groups=2,
                chunk_size=16,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                moe_shared_expert_intermediate_size=32,
            ),
        ),
        Family(
            "tiny-model-jamba",
            "jamba",
            dict(
                num_attention_heads=4,
                num_key_value_heads=2,
                num_hidden_layers=4,
                attn_layer_period=2,
                attn_layer_offset=1,
                num_experts=4,
                expert_layer_period=2,
                expert_layer_offset=1,
                mamba_d_state=8,
                mamba_dt_rank=8,
            ),
        ),
        Family("tiny-model-bamba", "bamba", dict(**_ATTN, num_hidden_layers=4, attn_layer_indices=[1, 3], **_MAMBA2)),
        Family(
            "tiny-model-granite-hybrid",
            "granitemoehybrid",
            dict(
                **_ATTN,
                num_hidden_layers=4,
                layer_types=["mamba", "attention", "mamba", "attention"],
                num_local_experts=4,
                shared_intermediate_size=32,
                **_MAMBA2,
            ),
        ),
        Family(
            "tiny-model-falcon-h1",
            "falcon_h1",
            dict(
                **_ATTN,
                num_hidden_layers=2,
                mamba_d_ssm=64,
                mamba_n_heads=4,
                mamba_d_head=16,
                mamba_n_groups=2,
                mamba_d_state=8,
                mamba_chunk_size=16,
            ),
        ),
        Family("tiny-model-deepseek-v3", "deepseek_v3", dict(**_MLA, num_hidden_layers=3)),
        # 8 indexer heads: with fewer, exact-zero score ties make the top-k order depend on shapes
        Family(
            "tiny-model-deepseek-v32",
            "deepseek_v32",
            dict(
                **_MLA,
                num_hidden_layers=3,
                index_head_dim=16,
                index_n_heads=8,
                index_topk=8,
                mlp_layer_types=["dense", "sparse", "sparse"],
            ),
            chunked_attention=False,
        ),
        # Real KV geometry (heads, head dims, window, state shapes, MLA/NSA dims) for GPU compute
        # times, bf16; fewer layers, 8 experts and a 32k vocabulary keep the weights a few GB.
        Family(
            "model-gpt-oss-120b",
            "gpt_oss",
            dict(
                **_REAL,
                hidden_size=2880,
                intermediate_size=2880,
                num_attention_heads=64,
                num_key_value_heads=8,
                head_dim=64,
                sliding_window=128,
                num_local_experts=8,
                num_experts_per_tok=4,
                num_hidden_layers=4,
                layer_types=["sliding_attention", "full_attention"] * 2,
            ),
            page_size=16,
            dtype="bfloat16",
            prefill_chunk=0,
        ),
        Family(
            "model-qwen3-next-80b",
            "qwen3_next",
            dict(
                **_REAL,
                hidden_size=2048,
                num_attention_heads=16,
                num_key_value_heads=2,
                head_dim=256,
                linear_key_head_dim=128,
                linear_value_head_dim=128,
                linear_num_key_heads=16,
                linear_num_value_heads=32,
                linear_conv_kernel_dim=4,
                num_hidden_layers=4,
                num_experts=8,
                num_experts_per_tok=4,
                moe_intermediate_size=512,
                shared_expert_intermediate_size=512,
            ),
            page_size=16,
            dtype="bfloat16",
            prefill_chunk=0,
        ),
        Family(
            "model-deepseek-v32",
            "deepseek_v32",
            dict(
                **_REAL,
                hidden_size=7168,
                intermediate_size=18432,
                num_attention_heads=128,
                num_key_value_heads=128,
                kv_lora_rank=512,
                q_lora_rank=1536,
                qk_rope_head_dim=64,
                qk_nope_head_dim=128,
                v_head_dim=128,
                index_head_dim=128,
                index_n_heads=64,
                index_topk=2048,
                n_routed_experts=8,
                num_experts_per_tok=4,
                moe_intermediate_size=2048,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                num_hidden_layers=3,
                mlp_layer_types=["dense", "sparse", "sparse"],
            ),
            page_size=64,
            dtype="bfloat16",
            chunked_attention=False,
            prefill_chunk=0,
        ),
    )
}


def family(preset: str) -> Family:
    try:
        return FAMILIES[preset]
    except KeyError:
        raise ConfigError(
            f"preset {preset!r} has no model code behind it (--engine model takes one of: {', '.join(FAMILIES)})"
        ) from None


def go_offline() -> None:
    """Before transformers is imported: no network, quiet logs; and the transformers installed is
    the minor the engine is tested with (check_transformers)."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    check_transformers()


# the transformers minor the model engine is tested with (pyproject's `model` extra pins it):
# the engine reads and rebuilds transformers' cache objects, and their model code changes how it
# keeps a cache between minors (5.17's deepseek-v3.2 indexer cache and nemotron-h state on CUDA
# failed what 5.23 passes)
TESTED_TRANSFORMERS = (5, 23)


def check_transformers(found: "str | None" = None) -> None:
    """ConfigError naming both versions where the installed transformers is another minor."""
    if found is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("transformers")
        except PackageNotFoundError:
            raise ConfigError("the model engine needs transformers: pip install 'disagg[model]'") from None
    parts = found.split(".")
    if tuple(int(p) if p.isdigit() else -1 for p in parts[:2]) != TESTED_TRANSFORMERS:
        want = ".".join(map(str, TESTED_TRANSFORMERS))
        raise ConfigError(
            f"the model engine is tested with transformers {want}.x and this environment has {found} "
            f"(model code keeps its cache differently between minors): pip install 'transformers=={want}.*' "
            "or 'disagg[model]'"
        )


def hf_config(f: Family):
    """transformers' config object for a family (imports transformers: seconds, once)."""
    go_offline()
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(f.model_type, **({**_BASE, **f.config} if f.tiny else f.config))
    except Exception as exc:  # an unknown model type, a config its class refuses (transformers' own words)
        words = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        raise ConfigError(f"{f.preset}: config refused: {words[:400]}") from None
