#!/usr/bin/env bash
# Issue 9: the row kernels (engine/kernels/quant/rows.py: one weight row per lane) on CUDA, their
# GPU tests, the decode tiles swept with them against the table's current tiles (the fastest per
# shape written to the table, copied to $OUT), then the captured 35B step profiled with that table.
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_quant_matmul.py -k "${TESTS_K:-row_kernel}" > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
echo "tests $(( $(date +%s) - t0 )) s"; grep -E "passed|failed" "$OUT/tests.log" | tail -1 || true
grep -E "^(FAILED|ERROR)|^E " "$OUT/tests.log" | head -10 || true
timeout ${SWEEP_S:-240} python3 bench/quant_matmul.py --sweep --qtypes Q4_0 --grid ${GRID:-rows} --verbose \
  --sweep-shapes ${SHAPES:-attn_qkv,attn_out,gdn_in,gdn_out,lm_head,experts} \
  --warmup 3 --repeats 20 --write-tuned engine/kernels/quant/tuned.json > "$OUT/tiles_sweep.log" 2>&1 \
  || echo "sweep rc=$?"
grep -v "^    " "$OUT/tiles_sweep.log" | grep -v Warn | tail -12 || true
cp engine/kernels/quant/tuned.json "$OUT/tuned.json" || true
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-100} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 8 --rows 30 > "$OUT/profile.log" 2>&1 || echo "profile rc=$?"
grep -E "experts|static step|decode step" "$OUT/profile.log" | head -6 || true
grep -E "_gemv|_moe|rows_kernel" "$OUT/profile.log" | head -8 | cut -c1-60,100-200 || true
