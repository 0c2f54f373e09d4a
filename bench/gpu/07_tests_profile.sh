#!/usr/bin/env bash
# The GPU-marked tests (quantized kernels last, time-boxed), then where a 35B decode step's
# time goes (torch.profiler), all-GPU, dense and quantized projections.
source "$(dirname "$0")/env.sh"
timeout ${TESTS_S:-300} python3 -m pytest -m gpu -q --tb=short -rfs -p no:cacheprovider --durations=20 \
  --ignore=tests/dashboard --ignore=tests/engine/kernels/test_quant_matmul.py tests > "$OUT/gpu_tests.log" 2>&1 || true
tail -40 "$OUT/gpu_tests.log"
luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
timeout ${PROFILE_S:-100} python3 bench/profile_decode.py --model /tmp/q35.gguf --steps 6 --rows 40 > "$OUT/profile_dense.log" 2>&1 || true
head -60 "$OUT/profile_dense.log"
timeout ${QUANT_S:-120} python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider tests/engine/kernels/test_quant_matmul.py \
  tests/engine/kernels/test_gdn_decode.py > "$OUT/quant_tests.log" 2>&1 || true
tail -25 "$OUT/quant_tests.log"
