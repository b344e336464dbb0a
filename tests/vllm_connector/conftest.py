"""vLLM tests: they run in the vLLM venv (.venv-vllm, `scripts/setup.sh --with vllm`), which
scripts/test.sh runs them with; the main venv does not collect this folder (tests/conftest.py).

Tiny random-weight checkpoints (tiny_models.py, also used by scripts/bench_vllm.py) are built
with transformers' save_pretrained: nothing is downloaded. vLLM's own connector test helpers
(tests/v1/kv_connector/unit/utils.py of its 0.32.0 sdist, Apache-2.0, the vLLM project) are
loaded from the copy scripts/setup.sh extracts into the venv, by path (not vendored here)."""

import importlib.util
import os
import sys
import warnings
from pathlib import Path

import pytest

with warnings.catch_warnings():  # vLLM and torch's inductor warn of their own deprecations on import
    warnings.simplefilter("ignore")
    import disagg.vllm.connector  # noqa: F401

from tiny_models import build_tiny_gemma3, build_tiny_llama, build_tiny_qwen3_next  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VLLM_TESTS = Path(os.environ.get("DISAGG_VLLM_TESTS", Path(sys.prefix) / "vllm-sdist-tests"))


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


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_next(tmp_path_factory) -> Path:
    return build_tiny_qwen3_next(tmp_path_factory.mktemp("tiny-qwen3-next"))


@pytest.fixture(scope="session")
def tiny_gemma3(tmp_path_factory) -> Path:
    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))
