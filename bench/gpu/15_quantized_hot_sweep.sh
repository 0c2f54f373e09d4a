#!/usr/bin/env bash
# The 35B budget sweep with both tiers in their Q4_0 blocks (issue 9 items 1-2, issue 3): budgets in
# quantized bytes, the all-hot point decoded from the captured graph; then the quantized hot tier's
# GPU tests.
source "$(dirname "$0")/env.sh"
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
timeout ${SWEEP_S:-360} python3 bench/budget_sweep.py --model /tmp/q35.gguf --points 0,25,50,75,100 --decode 32 --repeats 3 \
  --weights quantized --cold-format quantized --hot-format quantized --cuda-graph --json "$OUT/sweep_q4_hot.json" 2>&1 \
  | tee "$OUT/sweep_q4_hot.log" | grep -v Warn || true
FILES="tests/engine/test_hybrid_quantized.py" FILE_S=${FILE_S:-120} bash "$(dirname "$0")/10_tests_per_file.sh"
