#!/usr/bin/env bash
# The main job: set up (idempotent), then run disagg's end-to-end workload on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# A prefill worker, a decode worker and a router on loopback; a workload through them; every
# request verified byte by byte; exit code 0 only if all verified.
export MC_LOG_LEVEL=ERROR GLOG_minloglevel=2
exec .venv/bin/disagg demo "$@"
