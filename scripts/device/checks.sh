#!/usr/bin/env bash
# On the device (after scripts/device/carry.sh here): bash scripts/device/checks.sh 2>&1 | tee $OUT/log
# cuda-ipc conformance, then the TP resharding rows over cuda-ipc (all ranks on one GPU).
T0=$(date +%s)
source scripts/device/setup.sh || { echo SETUP FAILED; exit 3; }
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
DISAGG_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -m 'gpu or not gpu' -p no:cacheprovider \
  tests/transfer/test_two_process.py tests/transfer/test_prepared.py tests/transfer/test_streaming.py \
  tests/transfer/test_transports.py tests/transfer/test_reshard.py tests/disagg/worker/test_tp_instances.py \
  tests/transfer/test_suffix_send.py tests/transfer/test_engine_pool.py tests/transfer/test_sender_process.py \
  -k 'cuda-ipc or cuda_ipc or on_a_gpu or cuda'
echo "pytest rc=$?"
DISAGG_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider tests/transfer/test_gather.py
echo "gather on the device rc=$?"
# a sender process per prefill rank (every pool on the one GPU); the 64:16 group in a call of its own
timeout 330 python3 scripts/bench_tp.py --device cuda --transport cuda-ipc --tp 1:1,2:1,4:1,8:1,1:8,8:2 \
  --tokens 32768 --page-sizes 16 --repeats 3 --json > "$OUT/bench_tp.json"
echo "bench_tp rc=$? total $(( $(date +%s) - T0 )) s"
