#!/usr/bin/env bash
# 79 and 80 in one call on a fresh machine, for a session with little device time: the llama-bench build (carry
# .snap) and the 35B file at once, the prefetch's CUDA tests beside them (the device's work; the build has the
# cores), then, with the cores free, decode at half cold per count fetched and warmed (SHARES, FETCH, WARM: four
# rows by default) and the side by side at the fastest row (`80_prefetch_side_by_side.sh`, PROMPTS, DEPTHS).
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh" > "$OUT/build_start.log" 2>&1
start_q35
prefetch_tests 150
[ -z "$maker" ] || wait $maker
for _ in $(seq ${WAIT_S:-330}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
echo "llama-bench there after $SECONDS s"
timeout ${BENCH_S:-130} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0.6} \
  --prefetch ${FETCH:-0,2} --warm ${WARM:-0,2} --new-tokens 64 --repeats 3 --json "$OUT/cold_prefetch.json" 2>&1 \
  | grep -v Warn > "$OUT/cold_prefetch.log" || echo "decode rc=$?"
grep -E "share" "$OUT/cold_prefetch.log" || true
cp "$OUT/cold_prefetch.json" /tmp/cold_prefetch.json || true
# 80 at once: the build is there and the file written, so it reads the rows and runs the side by side
# (FETCH and WARM here are the sweep's lists, not the counts 80 takes)
env -u FETCH -u WARM WAIT_S=10 VS_S=${VS_S:-200} bash "$(dirname "$0")/80_prefetch_side_by_side.sh"
