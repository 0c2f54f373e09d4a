#!/usr/bin/env bash
# Issue 9, the decode kernels on CUDA: first their GPU tests (the in-kernel split-K sum, the split row
# layout of Q4_0/Q8_0 blocks, the fused and grouped quantized MoE launches, the tile table, the
# loader's layout and the cold tier read in place), then the tiles measured at the 35B shapes
# (bench/quant_matmul.py --sweep), written as the table the kernels read on this GPU (kept in
# $OUT/tuned.json for the repository), then the captured 35B step profiled with them, experts in Q4_0.
source "$(dirname "$0")/env.sh"
FILES="tests/engine/kernels/test_quant_matmul.py tests/engine/kernels/test_quant_tuned.py tests/engine/model/test_weights.py tests/engine/model/test_quantized_weights.py tests/engine/test_hybrid_cold_device.py tests/engine/test_hybrid_quantized.py" \
  FILE_S=${TESTS_S:-90} bash "$(dirname "$0")/10_tests_per_file.sh"
timeout ${SWEEP_S:-300} python3 bench/quant_matmul.py --sweep --qtypes ${QTYPES:-Q4_0} --warmup 5 --repeats 30 \
  --write-tuned engine/kernels/quant/tuned.json --json "$OUT/tiles_sweep.json" 2>&1 | tee "$OUT/tiles_sweep.log" | tail -14
cp engine/kernels/quant/tuned.json "$OUT/tuned.json" && cp engine/kernels/quant/tuned.json /tmp/tuned.json || true
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
timeout ${PROFILE_S:-150} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 8 --rows 25 > "$OUT/profile_tuned.log" 2>&1 || echo "profile rc=$?"
grep -E "experts|static step|decode step|Self CUDA time total" "$OUT/profile_tuned.log" | head -8 || true
