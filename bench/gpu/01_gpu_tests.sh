#!/usr/bin/env bash
# Every GPU-marked test (kernels, oracle, hybrid, DFlash, PFlash, training, tuner) on CUDA.
source "$(dirname "$0")/env.sh"
timeout ${TESTS_S:-540} python3 -m pytest -m gpu -q --tb=short -rfs -p no:cacheprovider --ignore=tests/dashboard \
  --ignore=tests/engine/kernels/test_quant_matmul.py tests 2>&1 | tee "$OUT/gpu_tests.log"
