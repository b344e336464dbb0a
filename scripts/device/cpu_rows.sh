#!/usr/bin/env bash
# On the device host's 16 cores (no GPU used; a demo invocation there takes ~45 s, its processes
# slow to import torch: budget the call's 600 s; bench_tp once started its decode ranks one after
# another and ran past its 240 s there; they start at once now, PeerProcess.start_many, and all its
# rows took 297 s: still run it in a call of its own, or the demo rows alone): issue 40's CPU rows,
# Mooncake TCP, side by side.
# bench_tp's host_cpu_ms beside each row's ms says whether the host's cores were the bound.
#   [BENCH=0] bash scripts/device/cpu_rows.sh [ROUNDS]   (after scripts/device/carry.sh here; writes $OUT)
#   ROUNDS 0: bench_tp alone; BENCH=0: the demo rounds alone (each fits one call of the device tool)
#   ROWS="1:1:16:16 8:1:16:16 ...": the demo rows to run (N:M:prefill pages:decode pages; default all
#   ten, ~450 s a round there); keep each page group's 1:1 first in a call of its own rows
# bench_tp (a process per prefill rank, every row beside its 1:1), then the demo rows, each round
# running 1:1 first so every N:M has a 1:1 of its own round to be divided by.
source scripts/device/setup.sh >/dev/null 2>&1 || { echo SETUP FAILED; exit 3; }
export PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
nproc; uptime
if [ "${BENCH:-1}" = 1 ]; then
  timeout 560 python3 scripts/bench_tp.py --tp 1:1,2:1,4:1,8:1,1:8,8:2 --tokens 1500 --page-sizes 16,64:16,16:64 \
    --repeats 3 --senders process --scatter-workers 4 --json > "$OUT/bench_tp_cpu.json" 2> "$OUT/bench_tp_cpu.err"
  echo "bench_tp cpu rc=$? at $(( $(date +%s) - T0 )) s"
fi
# each page group's own 1:1 first (mixed pages go gathered at 1:1): the base its rows are divided by
rows=${ROWS:-"1:1:16:16 2:1:16:16 4:1:16:16 8:1:16:16 1:8:16:16 8:2:16:16 1:1:64:16 8:1:64:16 1:1:16:64 1:8:16:64"}
for round in $(seq 1 "${1:-2}"); do
  for row in $rows; do
    IFS=: read -r n m p q <<< "$row"
    timeout 60 python3 -m disagg demo --preset gpt-oss-120b --prefill-tp "$n" --decode-tp "$m" \
      --prefill-page-size "$p" --decode-page-size "$q" --requests 4 --concurrency 1 --prompt-len 1500 \
      --max-tokens 8192 --json --no-progress 2>/dev/null | tr -d '\n' > /tmp/demo.json
    echo "demo round $round $row rc=${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
    echo "$round $n-${m}_$p-$q $(cat /tmp/demo.json)" >> "$OUT/demo_rows.txt"  # (one file: $OUT returns 8)
  done
done
[ -f "$OUT/demo_rows.txt" ] && python3 - "$OUT" <<'PY' | tee "$OUT/demo_summary.txt"
import json, sys
by = {}
for line in open(sys.argv[1] + "/demo_rows.txt"):
    rnd, row, *text = line.split(" ", 2)
    try:
        d = json.loads(text[0])
    except (IndexError, ValueError):
        print(rnd, row, "no JSON"); continue
    lat = d["latency_ms"]
    by.setdefault(row, []).append((int(rnd), lat["transfer"]["p50"], lat["kv_ready_after_compute"]["p50"], d["verified"], d["failed"]))
for row, xs in by.items():
    group = row.split("_", 1)[1]
    base = {r: (t, k) for r, t, k, *_ in by.get(f"1-1_{group}", [])}
    print(row, [(r, t, round(t / base[r][0], 2) if r in base else None, k, round(k / base[r][1], 2) if r in base and base[r][1] else None, v, f) for r, t, k, v, f in xs])
PY
