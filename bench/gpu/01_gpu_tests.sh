#!/usr/bin/env bash
# Every GPU-marked test (kernels, oracle, hybrid, DFlash, PFlash, training, tuner) on CUDA.
source "$(dirname "$0")/env.sh"
python3 -m pytest -m gpu -rs -p no:cacheprovider --ignore=tests/dashboard tests 2>&1 | tee "$OUT/gpu_tests.log"
