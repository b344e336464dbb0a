#!/usr/bin/env bash
# The main job: set up (idempotent), then run disagg's end-to-end workload.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if .venv/bin/disagg demo --help >/dev/null 2>&1; then
    exec .venv/bin/disagg demo "$@"
fi
echo "The prefill/decode server pair (disagg demo) arrives with the control-plane issue;"
echo "until then this runs what exists: the presets and the pool benchmark."
.venv/bin/disagg presets
exec .venv/bin/python scripts/bench_kvpool.py --tokens 32768 --repeats 2
