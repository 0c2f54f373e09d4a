#!/usr/bin/env bash
# Issue 9, after 37: the attention layers' cache write and output gate inside the Triton kernels (their
# GPU tests and the captured-step tests), then where PDL pays: the captured 35B step once per PDL
# setting (all on, off, and the expert and router launches without it), and prefill at 512 and 8K
# tokens with PDL on and off (prefill launches go without PDL since this tree; the last section's
# 512-token prefill fell from ~4,150 to ~2,000-2,400 tok/s).
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_rope_norm.py tests/engine/kernels/test_decode_attention.py tests/engine/kernels/test_pdl.py \
  tests/engine/model/test_decode_graph.py tests/engine/test_engine_decode_graph.py \
  -k "${TESTS_K:-cuda or hopper or replays or bf16_stays or identical_with_and_without or all_hot}" \
  > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
# the fused cache write and gated attention against their torch path, compiled on CUDA (not gpu-marked)
timeout 90 python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider tests/engine/kernels/test_rope_norm.py \
  -k "cache_write or static_attention" 2>&1 | grep -E "passed|failed|^E " | tail -4 || true
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-150} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 64 --no-profile --pdl-variants ${VARIANTS:-on,off,no-experts,no-router,no-experts+router,on} \
  > "$OUT/pdl_variants.log" 2>&1 || echo "variants rc=$?"
grep -E "PDL|decode step" "$OUT/pdl_variants.log" || true
for pdl in 1 0; do
  LUCE_TUNE_PDL=$pdl timeout ${BENCH_S:-120} python3 bench/engine_bench.py --model /tmp/q35.gguf --weights quantized \
    --experts quantized --prompt-lens 512,8192 --decode 64 --repeats 3 --json "$OUT/engine_bench_pdl$pdl.json" \
    > "$OUT/engine_bench_pdl$pdl.log" 2>&1 || echo "bench rc=$?"
  echo "PDL=$pdl"; grep -E "prefill|decode" "$OUT/engine_bench_pdl$pdl.log" || true
done
