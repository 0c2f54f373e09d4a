#!/usr/bin/env bash
# Issue 9, the CPU share's warm-ups by loads (-DLT_WARM_LOAD=1) against prefetches, in one call on a fresh machine
# (carry .whl, .vocab and .snap): first the pool alone on the host (bench/host_share_pool.py: 15 threads, jobs of
# POOL_PAIRS pairs on 6 layers of blocks, each cold and warmed first, per build, with the threads' phases), then
# 98_copier.sh's rows per build (CFLAGS, default: prefetching, loading, loading and warming ahead of the warm-up),
# count fetched (FETCH) and warmed (WARM) with the copier (COPIERS); VS=1 adds the llama-bench build and the side by
# side at the fastest row (more than a call's 10 minutes with the defaults: cut the rows, or run it in a second call).
source "$(dirname "$0")/env.sh"
timeout ${POOL_S:-90} python3 bench/host_share_pool.py --threads 15 --pairs ${POOL_PAIRS:-5,1} --jobs 60 --layers 6 \
  --activations int8 --warm --pinned "--cflags=${POOL_CFLAGS:--DLT_STATS=1 -DLT_WARM_LOAD=0;-DLT_STATS=1 -DLT_WARM_LOAD=1}" \
  --json "$OUT/pool_warm.json" 2>&1 | grep -v Warn > "$OUT/pool_warm.log" || echo "pool rc=$?"
cat "$OUT/pool_warm.log" || true
export VS=${VS:-0} COPIERS=${COPIERS:-engine} FETCH=${FETCH:-1,2} WARM=${WARM:-4,5} \
  CFLAGS=${CFLAGS:-"-DLT_WARM_LOAD=0;-DLT_WARM_LOAD=1;-DLT_WARM_LOAD=1 -DLT_SPEC=1"}
bash "$(dirname "$0")/98_copier.sh"
