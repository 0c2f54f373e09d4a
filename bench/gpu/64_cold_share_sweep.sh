#!/usr/bin/env bash
# The CPU share's pool alone on the host's cores (`bench/host_share_pool.py`, pinned blocks, THREADS), then
# decode from the 35B file at half the experts per share (`bench/cold_cpu_share.py`, SHARES); starts the
# llama-bench build when .snap is carried, for `18_vs_llamacpp.sh` with LUCE_TUNE_COLD_CPU_SHARE next.
source "$(dirname "$0")/env.sh"
[ ! -f .snap/llama-src.tar.xz ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
timeout ${POOL_S:-120} python3 bench/host_share_pool.py --pinned --threads ${THREADS:-1,8,15} --pairs 4 --jobs 100 \
  > "$OUT/host_share_pool.log" 2>&1 || echo "pool rc=$?"
tail -4 "$OUT/host_share_pool.log"
[ -z "$maker" ] || wait $maker
timeout ${BENCH_S:-300} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0,0.5,0.6,0.7,0.8} \
  --new-tokens ${NEW:-128} --repeats 3 --json "$OUT/cold_cpu_share.json" 2>&1 | grep -v Warn | tee "$OUT/cold_cpu_share.log" | tail -7
