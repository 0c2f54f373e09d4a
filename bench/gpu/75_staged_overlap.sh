#!/usr/bin/env bash
# The staged half-cold step with the bus's copies and the stage's expert launches on a second stream (the
# default): its CUDA tests, decode per share with the threads' job time and the step's timeline (SHARES), then
# the one-stream staged step (LUCE_TUNE_HYBRID_OVERLAP=0) at ONE shares in another process.
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider -m gpu \
  tests/engine/kernels/test_hybrid_split.py tests/engine/kernels/test_quant_matmul.py::test_cuda_stage_stack_real_shapes \
  tests/engine/test_hybrid_cpu_share.py tests/engine/test_hybrid_cold_device.py > "$OUT/tests.log" 2>&1 \
  || echo "tests rc=$?"
tests_summary $t0
timeout ${TESTS2_S:-60} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_hybrid_split.py > "$OUT/tests_split.log" 2>&1 || echo "split tests rc=$?"
tail -1 "$OUT/tests_split.log"
wait $maker
LUCE_TUNE_HOST_EXPERTS_CFLAGS=-DLT_STATS=1 timeout ${BENCH_S:-170} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
  --shares ${SHARES:-0,0.4,0.5} --new-tokens 64 --repeats 3 ${TIMELINE---timeline} \
  --json "$OUT/overlap.json" 2>&1 | grep -v Warn > "$OUT/overlap.log" || echo "overlap rc=$?"
grep -E "^share|captured step" "$OUT/overlap.log" || true
LUCE_TUNE_HYBRID_OVERLAP=0 timeout ${ONE_S:-100} python3 bench/cold_cpu_share.py --model /tmp/q35.gguf \
  --shares ${ONE:-0,0.4} --new-tokens 64 --repeats 3 --json "$OUT/one_stream.json" 2>&1 | grep -v Warn \
  > "$OUT/one_stream.log" || echo "one stream rc=$?"
grep -E "^share" "$OUT/one_stream.log" || true
