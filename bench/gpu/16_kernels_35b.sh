#!/usr/bin/env bash
# Issue 9 after the kernel work: the blockwise Q4_0/Q8_0 GEMV and expert kernels at the real shapes,
# the captured 35B decode step (quantized and dense projections) with its kernel table, and
# `luce-tune generate --cuda-graph` streaming from the real-shape file with its timings, then the GPU
# tests of the fused Gated DeltaNet prologue, the MoE gate kernels and the one-launch RMSNorm.
source "$(dirname "$0")/env.sh"
timeout ${KERNELS_S:-90} python3 bench/quant_matmul.py --qtypes Q4_0,Q8_0 --m 1,4 --json "$OUT/quant_matmul.json" \
  > "$OUT/quant_matmul.log" 2>&1 || echo "quant_matmul rc=$?"
tail -14 "$OUT/quant_matmul.log"
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
timeout ${PROFILE_S:-150} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --steps 8 --rows 25 \
  > "$OUT/profile_quantized.log" 2>&1 || echo "profile rc=$?"
grep -E "static step|decode step|Self CUDA time total" "$OUT/profile_quantized.log" | head -8 || true
timeout ${BENCH_S:-150} python3 bench/engine_bench.py --model /tmp/q35.gguf --prompt-lens 512,8192 --decode 32 --repeats 3 \
  --weights dense --json "$OUT/bench35b_dense.json" > "$OUT/bench35b_dense.log" 2>&1 || echo "bench rc=$?"
tail -5 "$OUT/bench35b_dense.log"
timeout ${GENERATE_S:-90} python3 -m tuner.cli generate --model /tmp/q35.gguf --prompt "def fibonacci(n):" -n 64 \
  --weights quantized --cuda-graph > "$OUT/generate.log" 2>&1 || echo "generate rc=$?"
tail -6 "$OUT/generate.log"
timeout ${MERGED_S:-120} python3 bench/merged_projections.py --model /tmp/q35.gguf --weights quantized --cuda-graph \
  --tokens 64 --repeats 3 --json "$OUT/merged_projections.json" 2>&1 | tail -3 || echo "merged rc=$?"
FILES="tests/engine/kernels/test_gdn_prologue.py tests/engine/kernels/test_moe_gate.py tests/engine/kernels/test_rms_norm.py tests/engine/kernels/test_rope_norm.py tests/engine/kernels/test_fused_fallback.py" FILE_S=${TESTS_S:-60} \
  bash "$(dirname "$0")/10_tests_per_file.sh"
