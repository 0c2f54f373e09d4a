#!/usr/bin/env bash
# The cold prefetch at the share it calls for. The tenth round timed fetching and warming ahead only at share 0.6, and
# the split hands the remaining cold pairs to the threads at the share *after* the fetched ones went to the bus and the
# warmed ones to the threads: fetching two put about 2.8 of a layer's 4 cold experts on the bus (1.6 without), warming
# two about 3.2 on the threads (2.4 without). Here: the 35B file in the background beside the prefetch's CUDA tests,
# then decode at half cold per share (SHARES), count fetched (FETCH) and warmed (WARM) with the cores free, the rows to
# /tmp/cold_prefetch.json for 80; with TIMELINE=1 the captured step in device order for the rows
# TL_SHARES x TL_FETCH x TL_WARM (0.6 x 0,2 x 0: what the side stream slows); the
# llama-bench build started at the end (carry .snap) for 80 on the warm machine.
source "$(dirname "$0")/env.sh"
start_q35
prefetch_tests 120
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
timeout ${BENCH_S:-300} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0.45,0.6,0.8,1.0} \
  --prefetch ${FETCH:-0,1,2} --warm ${WARM:-0,2} --new-tokens 64 --repeats 3 --json "$OUT/cold_prefetch.json" 2>&1 \
  | grep -v Warn > "$OUT/cold_prefetch.log" || echo "decode rc=$?"
grep -E "share" "$OUT/cold_prefetch.log" | sed 's/, same tokens.*ahead a layer/; ahead/' || true
cp "$OUT/cold_prefetch.json" /tmp/cold_prefetch.json || true
if [ -n "${TIMELINE:-}" ]; then  # the captured step in device order per row (TL_SHARES x TL_FETCH x TL_WARM)
  timeout ${TIMELINE_S:-150} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${TL_SHARES:-0.6} \
    --prefetch ${TL_FETCH:-0,2} --warm ${TL_WARM:-0} --new-tokens 32 --repeats 1 --timeline 2>&1 | grep -v Warn \
    > "$OUT/cold_prefetch_timeline.log" || echo "timeline rc=$?"
  grep -E "share|captured step|_split_kernel|_route_kernel|_gather3" "$OUT/cold_prefetch_timeline.log" | cut -c1-220 || true
fi
[ ! -f .snap/llama-src.tar.xz ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
