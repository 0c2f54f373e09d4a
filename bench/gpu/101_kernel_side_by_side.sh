#!/usr/bin/env bash
# Issue 9, the CPU share's four-block dot product on the GPU host, then the side by side, in one call on a fresh
# machine (carry .whl, .vocab, .snap, and OLD_SOURCE's folder: a copy of another version of
# engine/kernels/host_experts.c to compare). First, with the cores idle: bench/host_dot_rate.c per source (one core
# through the dot product from L2 and from memory; 15 threads at once, cold and warmed). Then the llama-bench build
# and the 35B file in the background, and beside them the copier's and the pool's tests (the pool's on this host's
# CPU). Once both are there: half-cold decode rows (bench/cold_cpu_share.py: placement alternate, share SHARE, the
# copier COPIER fetching FETCH, the threads warming WARM) in one process per source, the old source first; then
# bench/vs_llamacpp.py at the fastest row of this source with REPEATS repeats, in what is left of the call's
# 590 s (VS_MIN_S at least).
source "$(dirname "$0")/env.sh"
set +e
SRC=engine/kernels/host_experts.c
cc -O3 -march=native -pthread bench/host_dot_rate.c -o /tmp/host_dot_rate -lm || echo "cc rc=$?"
{ grep -m1 "model name" /proc/cpuinfo; echo "== this source"; /tmp/host_dot_rate; /tmp/host_dot_rate threads 15
  /tmp/host_dot_rate threads 15 200 512
  if [ -n "${OLD_SOURCE:-}" ]; then
    sed "s#../engine/kernels/host_experts.c#$PWD/$OLD_SOURCE#" bench/host_dot_rate.c > /tmp/host_dot_rate_old.c
    cc -O3 -march=native -pthread /tmp/host_dot_rate_old.c -o /tmp/host_dot_rate_old -lm || echo "cc old rc=$?"
    echo "== $OLD_SOURCE"; /tmp/host_dot_rate_old; /tmp/host_dot_rate_old threads 15; /tmp/host_dot_rate_old threads 15 200 512
  fi; } > "$OUT/dot_rate.log" 2>&1
grep -vE "^ +(warm-up|computed after prefetches)" "$OUT/dot_rate.log"
echo "dot rates after $SECONDS s"
start_q35
[ -x /tmp/llbuild/cmake/bin/llama-bench ] || env -u CFLAGS bash "$(dirname "$0")/17_llamacpp_build.sh" > /dev/null
t0=$(date +%s)
timeout ${KTESTS_S:-100} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_host_bus.py tests/engine/kernels/test_host_experts.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
for _ in $(seq ${WAIT_S:-300}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
echo "llama-bench there after $SECONDS s"; tail -1 /tmp/llbuild/build.log || true
rows() {  # $1: a label
  LUCE_TUNE_BLOCKING_WAIT=1 timeout ${ROWS_S:-100} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
    --new-tokens 64 --repeats 3 --placement-units alternate --shares ${SHARE:-0.45} --routes main \
    --prefetch ${FETCH:-2} --warm ${WARM:-5,4} --fetch-copiers ${COPIER:-engine} \
    --json "$OUT/rows_$1.json" 2>&1 | grep -v Warn > "$OUT/rows_$1.log" || echo "rows $1 rc=$?"
  grep -E "share" "$OUT/rows_$1.log" | sed "s/^/$1: /; s/, same tokens as the first row//; s/ (cuda_graph)//" | cut -c1-220
}
if [ -n "${OLD_SOURCE:-}" ]; then
  cp $SRC /tmp/host_experts_new.c && cp "$OLD_SOURCE" $SRC && rows old; cp /tmp/host_experts_new.c $SRC
  echo "old rows done after $SECONDS s"
fi
rows new
echo "new rows done after $SECONDS s"
read -r S F W C < <(python3 -c "
import json
r = max(json.load(open('$OUT/rows_new.json'))['rows'], key=lambda x: x['decode_tok_s']['median'])
print(r['share'], r['cold_prefetch'], r['cold_warm'], r['fetch_copier'])" 2>/dev/null || echo "${SHARE:-0.45} ${FETCH:-2} 5 ${COPIER:-engine}")
left=$(( 590 - SECONDS )); [ $left -ge ${VS_MIN_S:-120} ] || left=${VS_MIN_S:-120}
echo "side by side at share $S, fetch $F, warm $W, copier $C after $SECONDS s, box $left s"
LUCE_TUNE_FETCH_COPIER=$C LUCE_TUNE_BLOCKING_WAIT=1 timeout $left python3 bench/vs_llamacpp.py \
  --model /tmp/q35.gguf --llama-bench /tmp/llbuild/cmake/bin/llama-bench --prompts 0 --gen 64 --depths 0 \
  --repeats ${REPEATS:-5} --ncmoe 20 --weights quantized --experts quantized --cuda-graph --cold-device gpu \
  --cold-cpu-share "$S" --placement-unit alternate --cold-prefetch "$F" --cold-warm "$W" \
  --json "$OUT/vs_llamacpp.json" 2>&1 | grep -v Warn > "$OUT/vs_llamacpp.log" || echo "vs rc=$?"
tail -14 "$OUT/vs_llamacpp.log" || true
echo "done after $SECONDS s"
