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


def build_tiny_llama(path: Path) -> Path:
    """A 2-layer Llama (4 query heads, 2 KV heads of 64) with seeded random weights and a
    word-level tokenizer of VOCAB ids, saved as a HuggingFace checkpoint."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(VOCAB - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, torch_dtype="float32")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
