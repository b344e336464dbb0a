"""Tiny random-weight checkpoints for the vLLM tests and scripts/bench_vllm.py: built with
transformers' save_pretrained and a small word-level tokenizer; nothing is downloaded."""

from pathlib import Path

VOCAB = 512


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer of VOCAB ids ("w3" ... ): prompts are words, one token each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # /v1/chat/completions: the words
    fast.save_pretrained(path)


def save_random(model, path: Path, scale: float, head_scale: float = 1.0) -> Path:
    """Seeded uniform(-scale, scale) weights, the LM head's `head_scale` times as large (peaked
    logits: greedy choices are not near ties that rounding could flip)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-scale, scale)
        model.lm_head.weight.mul_(head_scale)
    model.save_pretrained(path)
    return path


def build_tiny_llama(path: Path) -> Path:
    """A 2-layer Llama (4 query heads, 2 KV heads of 64) with seeded random weights and a
    word-level tokenizer of VOCAB ids, saved as a HuggingFace checkpoint."""
    from transformers import LlamaConfig, LlamaForCausalLM

    save_tokenizer(path)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return save_random(LlamaForCausalLM(cfg), path, 0.5)


def build_wide_llama(path: Path) -> Path:
    """A 4-layer Llama with 8 KV heads of 128 (32 KiB of float32 KV per token: 64 MiB for a
    2k-token prompt), so a benchmark's transfer moves more than the tiny one's 2 KiB a token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    save_tokenizer(path)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return save_random(LlamaForCausalLM(cfg), path, 0.1)


def build_tiny_qwen3_next(path: Path) -> Path:
    """A 2-layer Qwen3-Next: a Gated DeltaNet layer (vLLM hands over its conv and SSM state)
    then a full-attention one, a 4-expert MoE; linear head dims 128 (what vLLM's CPU GDN
    kernels take)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    save_tokenizer(path)
    cfg = Qwen3NextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    return save_random(Qwen3NextForCausalLM(cfg), path, 0.1, head_scale=40.0)  # bf16: keep greedy margins wide


def build_tiny_gemma3(path: Path) -> Path:
    """A 2-layer Gemma3 text model: a sliding-window layer (window 64: a 100-token prompt
    leaves its first blocks) then a full-attention one: two KV cache groups in vLLM."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    save_tokenizer(path)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        query_pre_attn_scalar=64,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="float32",
    )
    return save_random(Gemma3ForCausalLM(cfg), path, 0.5)
