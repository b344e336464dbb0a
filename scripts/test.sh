#!/usr/bin/env bash
# Set up (idempotent, the vLLM test venv included), then run the test suite. Extra arguments go
# to pytest in the main venv; without any, tests/vllm_connector also runs, in the vLLM venv (.venv-vllm).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    cat <<'USAGE'
usage: scripts/test.sh [PYTEST ARGS...]
       scripts/test.sh -- [PYTEST ARGS...]    (everything after -- goes to pytest, -h included)

Sets up first (scripts/setup.sh --with vllm: Debian packages, kubectl, .venv, torch, Mooncake
and this package with its extras, and the vLLM test venv .venv-vllm; what is already in place
is skipped), then runs `.venv/bin/python -m pytest PYTEST ARGS...` from the repository root:
without arguments the whole suite (tests/), then tests/vllm_connector in .venv-vllm.

  scripts/test.sh                          # everything
  scripts/test.sh tests/disagg -x -q       # one folder, stop at the first failure
  scripts/test.sh -k bench -m "not slow"   # by name, without the slow tests
  scripts/test.sh -- --help                # pytest's own help
USAGE
}

case "${1:-}" in
    -h|--help) usage; exit 0 ;;
    --) shift ;;
esac
scripts/setup.sh --with vllm
status=0
.venv/bin/python -m pytest "$@" || status=$?
if [ $# -eq 0 ]; then
    .venv-vllm/bin/python -m pytest tests/vllm_connector || status=$?
fi
exit $status
