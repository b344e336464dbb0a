#!/usr/bin/env bash
# The main job: set up (idempotent), then run disagg's end-to-end workload on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if .venv/bin/disagg demo --help >/dev/null 2>&1; then
    exec .venv/bin/disagg demo "$@"
fi
# Until the prefill/decode server pair lands (control-plane issue): a sender process and a
# receiver process on loopback move fragmented gpt-oss-120b KV through Mooncake, every
# transfer verified byte-exact (exit code 1 otherwise), next to the raw engine ceiling.
export MC_LOG_LEVEL=ERROR GLOG_minloglevel=2
exec .venv/bin/python scripts/bench_transfer.py --quick "$@"
