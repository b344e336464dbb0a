#!/usr/bin/env bash
# Soak the pair under load with random kills: scripts/soak.sh [--duration SECONDS] [...]
set -euo pipefail
cd "$(dirname "$0")/.."
export MC_LOG_LEVEL=ERROR GLOG_minloglevel=2
exec .venv/bin/python scripts/soak.py "$@"
