#!/usr/bin/env bash
# On the device host's 16 cores (no GPU used): issue 40's bench_tp rows, Mooncake TCP, once per
# staged chunk size (the senders' --staging-chunk-kib; 0 = a whole 16 MiB slot), each beside
# its own 1:1. What a chunk size buys where cores are plenty: gathering, writing and decode's
# scatter overlap; what it costs: a notice, an ack and a write per chunk.
#   bash scripts/device/chunk_rows.sh [KIB...]   (after scripts/device/carry.sh here; writes $OUT)
source scripts/device/setup.sh >/dev/null 2>&1 || { echo SETUP FAILED; exit 3; }
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
nproc; uptime
for kib in "${@:-0 4096 2048 1024}"; do
  timeout 140 python3 scripts/bench_tp.py --tp 1:1,2:1,8:1,1:8,8:2 --tokens 1500 --page-sizes 16 \
    --repeats 5 --senders process --staging-chunk-kib "$kib" --json > "$OUT/chunk_$kib.json" 2> "$OUT/chunk_$kib.err"
  echo "chunk $kib KiB rc=$? at $(( $(date +%s) - T0 )) s"
  python3 - "$OUT/chunk_$kib.json" <<'PY'
import json, sys
try:
    j = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit(print("no JSON"))
for r in j["rows"]:
    print(f"  {r['tp']:>4} {r['page_size']}:{r['decode_page_size']} {r['ms']:7.2f} ms x1:1 {r['x_1to1']} cpu {r['host_cpu_ms']} ms")
PY
done
