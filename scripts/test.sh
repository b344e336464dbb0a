#!/usr/bin/env bash
# Set up (idempotent, the vLLM test venv included), then run the test suite. Extra arguments go
# to pytest in the main venv; without any, tests/vllm_connector also runs, in the vLLM venv (.venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --with vllm
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ $# -eq 0 ]; then
    .venv-vllm/bin/python -m pytest tests/vllm_connector || status=$?
fi
exit $status
