#!/usr/bin/env bash
# Cold experts fetched ahead of each layer's router from its predicted routing (`HybridExperts.set_cold_prefetch`):
# starts the llama-bench build (carry .snap) and the 35B file; the fetches' CUDA tests (the captured step with
# them against the all-on-device model, the split serving fetched rows, the side stream's router) and the CPU
# share's; waits for the build (WAIT_S) so that the threads have the cores; then decode at half cold per share
# (SHARES) and count fetched ahead (FETCH), the rows to /tmp/cold_prefetch.json for 80.
source "$(dirname "$0")/env.sh"
[ ! -f .snap/llama-src.tar.xz ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
  tests/engine/test_hybrid_prefetch.py tests/engine/test_hybrid_cpu_share.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
t0=$(date +%s)
timeout ${KTESTS_S:-120} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_hybrid_split.py tests/engine/kernels/test_moe_gate.py -k "split or select or route" \
  > "$OUT/tests_kernels.log" 2>&1 || echo "kernel tests rc=$?"
echo "kernel tests $(( $(date +%s) - t0 )) s"; grep -E "passed|failed" "$OUT/tests_kernels.log" | tail -1 || true
grep -E "^(FAILED|ERROR)|^E " "$OUT/tests_kernels.log" | head -10 || true
[ -z "$maker" ] || wait $maker
echo "35B file there after $SECONDS s"
if [ -f .snap/llama-src.tar.xz ]; then
  for _ in $(seq ${WAIT_S:-300}); do [ -x /tmp/llbuild/cmake/bin/llama-bench ] && break; sleep 1; done
  echo "llama-bench there after $SECONDS s: $(ls /tmp/llbuild/cmake/bin/llama-bench 2>/dev/null || echo missing)"
fi
timeout ${BENCH_S:-300} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf --shares ${SHARES:-0.5,0.6} \
  --prefetch ${FETCH:-0,1,2} --new-tokens 64 --repeats 3 --json "$OUT/cold_prefetch.json" 2>&1 | grep -v Warn \
  > "$OUT/cold_prefetch.log" || echo "decode rc=$?"
grep -E "share" "$OUT/cold_prefetch.log" || true
cp "$OUT/cold_prefetch.json" /tmp/cold_prefetch.json || true
