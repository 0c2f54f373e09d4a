#!/usr/bin/env bash
# Issue 9, the bus's fetch ahead by the copy engine (engine.kernels.host_experts.HostBus: a host thread queues the
# copies the select launch names; the stage's expert launch waits for their number), in one call on a fresh machine
# (carry .snap): the llama-bench build and the 35B file at once with the CUDA tests beside them (the copier's own, the
# prefetch's captured steps with either copier, the blocking wait's); once the build is done, half-cold decode
# (placement alternate, share SHARE) per count fetched (FETCH) and warmed (WARM), each with the copy launch and the
# copy engine in turn (COPIERS), per count of threads (THREADS, default one a core but one), in one process with the decode
# loop's wait set by WAIT (1: sleeping, which leaves the core of the process's main thread to the copier's), per build
# of the CPU share's pool (CFLAGS, ';' between builds: ";-DLT_SPEC=1" the default pool and the one warming ahead of
# its warm-ups); with TIMELINE=1 the fastest row's captured step in device order (its build with -DLT_STATS=1: the
# threads' time a job) and the stretch from one cold layer's select launch to the next;
# then `bench/vs_llamacpp.py` on the decode rows at the fastest (VS=0: not).
source "$(dirname "$0")/env.sh"
[ "${VS:-1}" = 0 ] || [ -x /tmp/llbuild/cmake/bin/llama-bench ] || env -u CFLAGS bash "$(dirname "$0")/17_llamacpp_build.sh"  # CFLAGS: pool builds, not cmake's
start_q35
t0=$(date +%s)
timeout ${KTESTS_S:-60} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_host_bus.py \
  > "$OUT/tests_bus.log" 2>&1 || echo "copier tests rc=$?"
grep -E "passed|failed" "$OUT/tests_bus.log" | tail -1 || true
grep -E "^(FAILED|ERROR)|^E " "$OUT/tests_bus.log" | head -8 || true
t0=$(date +%s)
timeout ${TESTS_S:-200} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
  $(for c in q4_0-1-6-alternate-main-8-kernel {q4_0,q8_0}-{1-6-alternate-main-8,2-0-expert-side-0,2-5-alternate-main-8,4-4-alternate-side-0}-engine; do
    echo "tests/engine/test_hybrid_cpu_share.py::test_cuda_captured_step_with_fetches_follows_the_device_model[$c]"; done) \
  "tests/engine/test_hybrid_cpu_share.py::test_cuda_captured_step_with_warm_ups_ahead_follows_the_device_model" \
  "tests/engine/test_engine_decode_graph.py::test_cuda_blocking_wait_decodes_the_same_tokens" \
  > "$OUT/tests.log" 2>&1 \
  || echo "tests rc=$?"
tests_summary $t0
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
if [ "${VS:-1}" = 1 ]; then
  for _ in $(seq ${WAIT_S:-300}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
  echo "llama-bench there after $SECONDS s"; tail -1 /tmp/llbuild/build.log || true
fi
WAIT=${WAIT:-1}
LUCE_TUNE_BLOCKING_WAIT=$WAIT timeout ${ROWS_S:-260} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
  --new-tokens 64 --repeats 3 --placement-units alternate --shares ${SHARE:-0.45} --routes main \
  --prefetch ${FETCH:-1,2,3} --warm ${WARM:-6,5} --fetch-copiers ${COPIERS:-kernel,engine} \
  ${THREADS:+--threads $THREADS} ${CFLAGS:+--cflags "$CFLAGS"} \
  --json "$OUT/copier_rows.json" 2>&1 | grep -v Warn > "$OUT/copier_rows.log" || echo "rows rc=$?"
grep -E "share" "$OUT/copier_rows.log" | sed 's/, same tokens as the first row//; s/ (cuda_graph)//' | cut -c1-260 || true
read -r S F W C N CF < <(python3 -c "
import json
r = max(json.load(open('$OUT/copier_rows.json'))['rows'], key=lambda x: x['decode_tok_s']['median'])
print(r['share'], r['cold_prefetch'], r['cold_warm'], r['fetch_copier'], r['threads'], r['cflags'] or '')" \
  2>/dev/null || echo "0.45 1 5 kernel 15")
if [ "${TIMELINE:-0}" = 1 ]; then  # the fastest row's captured step in device order
  LUCE_TUNE_BLOCKING_WAIT=$WAIT timeout ${TL_S:-90} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
    --new-tokens 32 --repeats 1 --placement-units alternate --shares "$S" --routes main --prefetch "$F" --warm "$W" \
    --fetch-copiers "$C" --cflags "$CF -DLT_STATS=1" --timeline 2>&1 | grep -v Warn > "$OUT/copier_timeline.log" || echo "timeline rc=$?"
  grep -E "span|share|_collect|_gather|_bus_wait|moe_|from one" "$OUT/copier_timeline.log" | cut -c1-200 | head -24 || true
fi
[ "${VS:-1}" = 1 ] || { echo "done after $SECONDS s"; exit 0; }
echo "side by side at share $S, fetch $F, warm $W, copier $C, $N threads, build '$CF', wait $WAIT after $SECONDS s"
LUCE_TUNE_HOST_EXPERTS_CFLAGS="$CF" LUCE_TUNE_FETCH_COPIER=$C LUCE_TUNE_BLOCKING_WAIT=$WAIT timeout ${VS_S:-240} python3 bench/vs_llamacpp.py \
  --model /tmp/q35.gguf --llama-bench /tmp/llbuild/cmake/bin/llama-bench --prompts 0 --gen 64 --depths 0 \
  --repeats ${REPEATS:-3} --ncmoe 20 --weights quantized --experts quantized --cuda-graph --cold-device gpu \
  --cold-cpu-share "$S" --placement-unit alternate --cold-prefetch "$F" --cold-warm "$W" \
  --json "$OUT/vs_llamacpp.json" 2>&1 | grep -v Warn > "$OUT/vs_llamacpp.log" || echo "vs rc=$?"
tail -14 "$OUT/vs_llamacpp.log" || true
echo "done after $SECONDS s"
