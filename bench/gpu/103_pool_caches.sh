#!/usr/bin/env bash
# Issue 9, no model file (carry .whl and .vocab; about 2 minutes): do the host's caches hold a cold layer's blocks
# for the CPU threads? bench/host_share_pool.py with 15 threads on 6 layers of pinned blocks, jobs of POOL_PAIRS
# pairs, each row three ways: cold, warmed first (the warm-up ahead of the router, waited out), and again (the same
# job run twice, the second timed), per build (POOL_CFLAGS: prefetching and loading warm-ups, with the threads'
# phases), first with the cores alone, then with host -> device copies running beside them (--bus) as in the
# half-cold step. The warmed job as slow as the cold one while the repeated one is fast: the warm-up does not put
# the blocks where the job reads them. Both as slow: the caches do not hold them.
source "$(dirname "$0")/env.sh"
set +e
grep -m1 "model name" /proc/cpuinfo; lscpu | grep -E "^(L2|L3|Thread|Core|Socket|NUMA)" || true
for bus in "" --bus; do
  name=pool_caches${bus:+_bus}
  timeout ${POOL_S:-120} python3 bench/host_share_pool.py --threads 15 --pairs ${POOL_PAIRS:-4,6} --jobs 100 \
    --layers 6 --activations int8 --warm --again --pinned $bus \
    "--cflags=${POOL_CFLAGS:--DLT_STATS=1 -DLT_WARM_LOAD=0;-DLT_STATS=1 -DLT_WARM_LOAD=1}" \
    --json "$OUT/$name.json" 2>&1 | grep -v Warn > "$OUT/$name.log"
  echo "== ${bus:-cores alone} rc=${PIPESTATUS[0]} after $SECONDS s"
  cat "$OUT/$name.log"
done
