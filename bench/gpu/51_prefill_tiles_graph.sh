#!/usr/bin/env bash
# Issue 9, 48 and 50 in one call: the prefill launches' CUDA tests now that the GEMM and the grouped down
# launch share one tile loop (_rows_dot), the captured padded prefill's CUDA tests and the engine's greedy
# identity with and without it, then the 35B file's prefill at 100-4,096 tokens (odd lengths, padded to
# the next bucket) eagerly and captured, in alternating runs (bench/engine_bench.py --prefill-graph both).
source "$(dirname "$0")/env.sh"
start_q35
prefill_tile_tests
prefill_graph_tests
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${BENCH_S:-240} python3 bench/engine_bench.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --prompt-lens ${LENS:-100,300,512,700,1100,2048,2500,4096} --decode 4 --repeats 3 --prefill-graph both --json "$OUT/engine_bench.json" \
  > "$OUT/engine_bench.log" 2>&1 || echo "bench rc=$?"
grep -E "loaded|prefill|decode|Error|error" "$OUT/engine_bench.log" || true
