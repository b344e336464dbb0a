#!/usr/bin/env bash
# On the device host's 16 cores (no GPU used): issue 40's bench_tp rows once per engine count of
# every process (--mooncake-engines: a decode rank's N senders land on N engines, each its own
# receiving thread).
#   [TP=1:1,8:1] bash scripts/device/engine_rows.sh [PAGE_SIZES] [ENGINES...]   (after scripts/device/carry.sh here; writes $OUT)
pages=${1:-16}; shift || true
[ $# -gt 0 ] || set -- 1 4
PAGES=$pages exec bash scripts/device/sweep_rows.sh --mooncake-engines "$@"
