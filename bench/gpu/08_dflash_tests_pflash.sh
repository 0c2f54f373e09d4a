#!/usr/bin/env bash
# The DFlash CUDA tests verbosely (their failures' tracebacks), the slow end of the MoE kernel
# tests with durations, then the PFlash NIAH/TTFT table (04_pflash.sh).
source "$(dirname "$0")/env.sh"
timeout ${DFLASH_TESTS_S:-120} python3 -m pytest -m gpu -o addopts="" -v --tb=long -p no:cacheprovider \
  tests/engine/dflash/test_gpu.py > "$OUT/dflash_tests.log" 2>&1 || true
grep -E "PASSED|FAILED|Error|assert" "$OUT/dflash_tests.log" | head -40
timeout ${MOE_TESTS_S:-90} python3 -m pytest -m gpu -o addopts="" -v --durations=10 -p no:cacheprovider \
  tests/engine/kernels/test_moe.py -k "512 or cold" > "$OUT/moe_tests.log" 2>&1 || true
grep -E "PASSED|FAILED|s call" "$OUT/moe_tests.log" | head -20
BUDGETS=${BUDGETS:-all} PFLASH_S=${PFLASH_S:-330} bash "$(dirname "$0")/04_pflash.sh" > /dev/null 2>&1 || true
tail -40 "$OUT/pflash${TAG:-}.log"
