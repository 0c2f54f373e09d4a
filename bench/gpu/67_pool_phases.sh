#!/usr/bin/env bash
# Where the CPU share's pool spends a job on the device's host (`bench/host_share_pool.py` built with
# -DLT_STATS=1: the pool's own time a job and its phases per thread count), with threads pinned to cores
# and with the AVX2 build beside the default (VARIANTS, ';' between builds). No model file.
source "$(dirname "$0")/env.sh"
V=${VARIANTS:-"-DLT_STATS=1;-DLT_STATS=1 -DLT_PIN=1;-DLT_STATS=1 -mno-avx512f"}
lscpu | grep -o -E "avx512_vnni|avx512_bf16|amx_int8|amx_bf16|avx_vnni|avx512f " | sort -u | tr '\n' ' ' | tee "$OUT/flags.txt"; echo
timeout ${POOL_S:-300} python3 bench/host_share_pool.py --pinned --threads ${THREADS:-1,4,8,15} --pairs ${PAIRS:-4,8} \
  --jobs ${JOBS:-100} --cflags="$V" 2>&1 | grep -v Warn | tee "$OUT/pool_phases.log"
