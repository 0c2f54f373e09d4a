#!/usr/bin/env bash
# The 50% expert budget rows of the PFlash table (04_pflash.sh), after the first failing DFlash
# CUDA rollback test with its traceback.
source "$(dirname "$0")/env.sh"
timeout ${DFLASH_TESTS_S:-60} python3 -m pytest -m gpu -o addopts="" -x -q --tb=short -p no:cacheprovider \
  "tests/engine/dflash/test_gpu.py::test_rollback_on_cuda_equals_plain" > "$OUT/dflash_tests.log" 2>&1 || true
grep -E "^E |Error|passed|failed" "$OUT/dflash_tests.log" | head -20
BUDGETS=50% TAG=_half PFLASH_S=${PFLASH_S:-420} bash "$(dirname "$0")/04_pflash.sh" > /dev/null 2>&1 || true
tail -22 "$OUT/pflash_half.log"
