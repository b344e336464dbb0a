"""vLLM tests: they run in the vLLM venv (.venv-vllm, `scripts/setup.sh --with vllm`), which
scripts/test.sh runs them with; the main venv does not collect this folder (tests/conftest.py).

A tiny random-weight Llama and a small word-level tokenizer are built here with transformers'
save_pretrained: nothing is downloaded. vLLM's own connector test helpers
(tests/v1/kv_connector/unit/utils.py of its 0.32.0 sdist, Apache-2.0, the vLLM project) are
loaded from the copy scripts/setup.sh extracts into the venv, by path (not vendored here)."""

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():   # vLLM and torch's inductor warn of their own deprecations on import
    warnings.simplefilter("ignore")
    import disagg.vllm.connector  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
VLLM_TESTS = Path(os.environ.get("DISAGG_VLLM_TESTS", Path(sys.prefix) / "vllm-sdist-tests"))
VOCAB = 512


def pytest_collection_modifyitems(config, items):
    """vLLM's and torch's own deprecation and resource warnings are theirs, not failures of ours."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.filterwarnings("ignore::DeprecationWarning"))
            item.add_marker(pytest.mark.filterwarnings("ignore::FutureWarning"))


@pytest.fixture(scope="session")
def vllm_utils():
    """vLLM's tests/v1/kv_connector/unit/utils.py (create_vllm_config, create_scheduler, ...)."""
    path = VLLM_TESTS / "tests" / "v1" / "kv_connector" / "unit" / "utils.py"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: run scripts/setup.sh --with vllm (it extracts vLLM's test helpers)")
    spec = importlib.util.spec_from_file_location("vllm_kv_connector_test_utils", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def save_tokenizer(path: Path) -> None:
    """A word-level tokenizer of VOCAB ids ("w3" ... ): prompts are words, one token each."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
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
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    return save_random(LlamaForCausalLM(cfg), path, 0.5)


def build_tiny_qwen3_next(path: Path) -> Path:
    """A 2-layer Qwen3-Next: a Gated DeltaNet layer (vLLM hands over its conv and SSM state)
    then a full-attention one, a 4-expert MoE; linear head dims 128 (what vLLM's CPU GDN
    kernels take)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    save_tokenizer(path)
    cfg = Qwen3NextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                          layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=2,
                          linear_key_head_dim=128, linear_value_head_dim=128, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=128, shared_expert_intermediate_size=128,
                          max_position_embeddings=1024, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    return save_random(Qwen3NextForCausalLM(cfg), path, 0.1, head_scale=40.0)   # bf16: keep greedy margins wide


def build_tiny_gemma3(path: Path) -> Path:
    """A 2-layer Gemma3 text model: a sliding-window layer (window 64: a 100-token prompt
    leaves its first blocks) then a full-attention one: two KV cache groups in vLLM."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    save_tokenizer(path)
    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           layer_types=["sliding_attention", "full_attention"], sliding_window=64,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                           max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                           torch_dtype="float32")
    return save_random(Gemma3ForCausalLM(cfg), path, 0.5)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory) -> Path:
    return build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))
