#!/usr/bin/env bash
# On the device host's 16 cores (no GPU used): issue 40's bench_tp rows, Mooncake TCP, once per
# value of one of bench_tp's flags, each run beside its own 1:1 (chunk_rows.sh and
# engine_rows.sh are two such sweeps).
#   [TP=1:1,8:1] [PAGES=16] [LIMIT_S=280] bash scripts/device/sweep_rows.sh FLAG VALUE...
#   (after scripts/device/carry.sh here; writes $OUT/<flag>_<value>.json)
source scripts/device/setup.sh >/dev/null 2>&1 || { echo SETUP FAILED; exit 3; }
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
flag=$1; shift; name=${flag#--}
nproc; uptime
for value in "$@"; do
  timeout "${LIMIT_S:-280}" python3 scripts/bench_tp.py --tp "${TP:-1:1,2:1,4:1,8:1,1:8,8:2}" --tokens 1500 \
    --page-sizes "${PAGES:-16}" --repeats 5 --senders process "$flag" "$value" --json \
    > "$OUT/${name}_$value.json" 2> "$OUT/${name}_$value.err"
  echo "$flag $value rc=$? at $(( $(date +%s) - T0 )) s"
  python3 scripts/device/print_rows.py "$OUT/${name}_$value.json"
done
