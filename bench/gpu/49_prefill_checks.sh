#!/usr/bin/env bash
# Issue 9, after 48 (dequant_min_m 4096, whole-block prefill tiles, the add + norm inside the router's
# launch): the CUDA tests of the quantized paths on the trained model and the captured steps (greedy
# output of the quantized path against the dense one, the hot tier through the Triton kernels, the graph
# against eager), then the engine's own prefill and decode figures on the 35B file (bench/engine_bench.py).
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-200} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/model/test_quantized_weights.py tests/engine/test_hybrid_quantized.py \
  tests/engine/test_engine_decode_graph.py tests/engine/kernels/test_moe_gate.py \
  -k "${TESTS_K:-cuda or graph or triton or identical or all_hot}" > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${BENCH_S:-180} python3 bench/engine_bench.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --prompt-lens 512,2048,8192 --decode 64 --repeats 3 --json "$OUT/engine_bench.json" \
  > "$OUT/engine_bench.log" 2>&1 || echo "bench rc=$?"
grep -E "loaded|prefill|decode" "$OUT/engine_bench.log" || true
