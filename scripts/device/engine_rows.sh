#!/usr/bin/env bash
# On the device host's 16 cores (no GPU used): issue 40's bench_tp rows, Mooncake TCP, once per
# engine count of every process (--mooncake-engines: a decode rank's N senders land on N
# engines, each its own receiving thread), each beside its own 1:1.
#   [TP=1:1,8:1] bash scripts/device/engine_rows.sh [PAGE_SIZES] [ENGINES...]   (after scripts/device/carry.sh here; writes $OUT)
source scripts/device/setup.sh >/dev/null 2>&1 || { echo SETUP FAILED; exit 3; }
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
pages=${1:-16}; shift || true
nproc; uptime
for engines in "${@:-1 4}"; do
  timeout 280 python3 scripts/bench_tp.py --tp "${TP:-1:1,2:1,4:1,8:1,1:8,8:2}" --tokens 1500 --page-sizes "$pages" \
    --repeats 5 --senders process --mooncake-engines "$engines" --json > "$OUT/engines_$engines.json" 2> "$OUT/engines_$engines.err"
  echo "engines $engines rc=$? at $(( $(date +%s) - T0 )) s"
  python3 - "$OUT/engines_$engines.json" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit(print("no JSON"))
for r in j["rows"]:
    print(f"  {r['tp']:>4} {r['page_size']}:{r['decode_page_size']} {r['ms']:7.2f} ms x1:1 {r['x_1to1']} "
          f"verified {r['verified']} cpu {r['host_cpu_ms_by_role']}")
PY
done
