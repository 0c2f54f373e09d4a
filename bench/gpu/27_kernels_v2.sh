#!/usr/bin/env bash
# Issue 9, the second round of decode kernels on CUDA: their GPU tests first (the split-key decode
# attention, the shared expert inside the routed launches, the quantized MoE and split layout at
# real shapes, the captured step against eager), then the tile sweep timed inside CUDA graphs
# (written to engine/kernels/quant/tuned.json, copied to $OUT and /tmp), then the captured 35B step
# profiled with Q4_0 experts. Starts the llama-bench build in the background first (carry .snap) for
# 18_vs_llamacpp.sh in the next call.
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh" > /tmp/llstart.log 2>&1 || true
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-200} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_decode_attention.py tests/engine/model/test_decode_graph.py \
  tests/engine/kernels/test_quant_matmul.py tests/engine/test_hybrid_quantized.py \
  -k "cuda_real_shapes or graph or cuda_shared or cuda_quantized_moe or cuda_split_layout or cuda_quantized" \
  > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
echo "tests $(( $(date +%s) - t0 )) s"; grep -E "passed|failed" "$OUT/tests.log" | tail -2
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 || true
timeout ${SWEEP_S:-170} python3 bench/quant_matmul.py --sweep --qtypes Q4_0 --warmup 3 --repeats 20 \
  --write-tuned engine/kernels/quant/tuned.json --json "$OUT/tiles_sweep.json" 2>&1 | tee "$OUT/tiles_sweep.log" \
  | grep -v Warn | tail -12
cp engine/kernels/quant/tuned.json "$OUT/tuned.json" && cp engine/kernels/quant/tuned.json /tmp/tuned.json || true
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-130} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 8 --rows 30 > "$OUT/profile.log" 2>&1 || echo "profile rc=$?"
grep -E "experts|static step|decode step" "$OUT/profile.log" | head -6 || true
