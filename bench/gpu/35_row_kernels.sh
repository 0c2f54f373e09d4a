#!/usr/bin/env bash
# Issue 9: the row kernels (engine/kernels/quant/rows.py: one weight row per lane) on CUDA, their
# GPU tests, the decode tiles swept with them against the table's current tiles (the fastest per
# shape written to the table, copied to $OUT), then the captured 35B step profiled with that table.
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_quant_matmul.py -k "${TESTS_K:-row_kernel}" > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
sweep_tiles ${GRID:-rows}
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-100} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 8 --rows 30 > "$OUT/profile.log" 2>&1 || echo "profile rc=$?"
grep -E "experts|static step|decode step" "$OUT/profile.log" | head -6 || true
grep -E "_gemv|_moe|rows_kernel" "$OUT/profile.log" | head -8 | cut -c1-60,100-200 || true
