#!/usr/bin/env bash
# Issue 9: the captured padded prefill (engine/model/prefill_graph.py). Its CUDA tests and the engine's
# greedy identity with and without it (TESTS_S box), then prefill at 512 and 2,048 tokens on the 35B
# file through it (bench/engine_bench.py --prefill-graph: the warm-up call at each length captures). First
# run: the capture test failed inside its 75 s box and nothing else finished; give it TESTS_S=150 BENCH_S=150.
source "$(dirname "$0")/env.sh"
start_q35
GRAPH_TESTS_S=${TESTS_S:-150} prefill_graph_tests
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${BENCH_S:-100} python3 bench/engine_bench.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --prompt-lens ${LENS:-512,2048} --decode 4 --repeats 3 --prefill-graph on --json "$OUT/engine_bench.json" \
  > "$OUT/engine_bench.log" 2>&1 || echo "bench rc=$?"
grep -E "loaded|prefill|decode" "$OUT/engine_bench.log" || true
