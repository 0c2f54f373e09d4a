#!/usr/bin/env bash
# Issue 9: loads before the PDL wait (engine.kernels.pdl.PREFETCH: the router's weights, the delta rule's state,
# the experts' down launch's ids and codes after a gate/up launch that waits first). Starts the llama-bench
# build when `.snap` is carried and the 35B file in the background; the kernels' CUDA tests beside them
# (prefetch on and off bit for bit, the per-pair down launch at the real shapes, the delta rule, the router, in a
# TESTS_S box); then decode through the engine per setting of BENCH_SETTINGS (LUCE_TUNE_PDL_PREFETCH, each in
# a process of its own, BENCH_S box each) and, with VARIANTS, the captured 35B step with the prefetch off and on
# in alternating captures of one process (PROFILE_S box).
source "$(dirname "$0")/env.sh"
[ ! -f .snap/llama-src.tar.xz ] || bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-200} python3 -m pytest -m "gpu or not gpu" -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_prefetch.py tests/engine/kernels/test_quant_matmul.py -k "prefetch or shared_expert_rides" \
  > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary "$t0"
[ -z "$maker" ] || wait $maker
for p in ${BENCH_SETTINGS:-1 0 1 0}; do
  t1=$(date +%s)
  LUCE_TUNE_PDL_PREFETCH=$p timeout ${BENCH_S:-200} python3 bench/engine_bench.py --model /tmp/q35.gguf --weights quantized \
    --experts quantized --prompt-lens 512 --decode 256 --repeats 5 --graph-only >> "$OUT/bench_prefetch_$p.log" 2>&1 \
    || echo "bench rc=$?"
  echo "PREFETCH=$p ($(( $(date +%s) - t1 )) s): $(grep -E "^(prefill|decode)" "$OUT/bench_prefetch_$p.log" | tail -2 | tr '\n' ' ')"
done
if [ -n "${VARIANTS:-}" ]; then
  timeout ${PROFILE_S:-240} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
    --steps 64 --no-eager --no-profile --kernel-variants "$VARIANTS" > "$OUT/profile_prefetch.log" 2>&1 || echo "profile rc=$?"
  grep -E "^(kernels|decode step|static)" "$OUT/profile_prefetch.log" || tail -5 "$OUT/profile_prefetch.log" || true
fi
