#!/usr/bin/env bash
# The captured decode step on the H200 at last (issue 9 item 3): the 35B shapes with Q4_0
# projections kept quantized, eager against replayed graph, each with its kernel table; then
# dense bf16 decode and prefill at 512 and 8K through engine_bench; then the decode-graph and
# hybrid GPU tests (issue 3's logits on CUDA), each file in its own time box.
source "$(dirname "$0")/env.sh"
luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
timeout ${PROFILE_S:-150} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --steps 8 --rows 25 \
  > "$OUT/profile_quantized.log" 2>&1 || echo "profile rc=$?"
grep -E "static step|decode step|decode graph|Self CUDA time total|Self CPU time total|Error|error" "$OUT/profile_quantized.log" | head -20 || true
timeout ${BENCH_S:-170} python3 bench/engine_bench.py --model /tmp/q35.gguf --prompt-lens 512,8192 --decode 32 --repeats 3 \
  --weights dense --json "$OUT/bench35b_dense.json" > "$OUT/bench35b_dense.log" 2>&1 || echo "bench rc=$?"
tail -8 "$OUT/bench35b_dense.log"
FILES="tests/engine/model/test_decode_graph.py tests/engine/test_engine_decode_graph.py tests/engine/test_hybrid.py" \
  FILE_S=${FILE_S:-80} bash "$(dirname "$0")/10_tests_per_file.sh"
