#!/usr/bin/env bash
# On the device host's 16 cores (no GPU used): issue 40's bench_tp rows once per staged chunk
# size (the senders' --staging-chunk-kib; 0 = a whole 16 MiB slot). What a chunk size buys where
# cores are plenty: gathering, writing and decode's scatter overlap; what it costs: a notice, an
# ack and a write per chunk.
#   bash scripts/device/chunk_rows.sh [KIB...]   (after scripts/device/carry.sh here; writes $OUT)
[ $# -gt 0 ] || set -- 0 4096 2048 1024
TP=${TP:-1:1,2:1,8:1,1:8,8:2} LIMIT_S=${LIMIT_S:-140} exec bash scripts/device/sweep_rows.sh --staging-chunk-kib "$@"
