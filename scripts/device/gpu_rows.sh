#!/usr/bin/env bash
# On the device (after scripts/device/carry.sh here): issue 40's resharding rows over cuda-ipc,
# every rank on the one GPU, under the MPS control daemon (without it the GPU time-slices the
# ranks' CUDA contexts, so N senders' copies run one after another: docs/bench_tp_gpu.json,
# session_9_mps), each TP row beside its own page group's 1:1.
#   [TP=1:1,2:1,4:1,8:1,1:8,8:2] [PAGES=16,64:16] [MPS=1] bash scripts/device/gpu_rows.sh
#   (writes $OUT/bench_tp_gpu_mps<MPS>.json and .err)
source scripts/device/setup.sh >/dev/null 2>&1 || { echo SETUP FAILED; exit 3; }
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; T0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc
if [ "${MPS:-1}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog
  mkdir -p /tmp/mps /tmp/mpslog && nvidia-cuda-mps-control -d && echo "MPS daemon up"
fi
timeout "${LIMIT_S:-540}" python3 scripts/bench_tp.py --device cuda --transport cuda-ipc \
  --tp "${TP:-1:1,2:1,4:1,8:1,1:8,8:2}" --tokens 32768 --page-sizes "${PAGES:-16,64:16}" --repeats 3 --json \
  > "$OUT/bench_tp_gpu_mps${MPS:-1}.json" 2> "$OUT/bench_tp_gpu_mps${MPS:-1}.err"
echo "bench_tp rc=$? at $(( $(date +%s) - T0 )) s"
[ "${MPS:-1}" = 1 ] && echo quit | nvidia-cuda-mps-control
python3 scripts/device/print_rows.py "$OUT/bench_tp_gpu_mps${MPS:-1}.json"
