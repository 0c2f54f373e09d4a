#!/usr/bin/env bash
# Issue 9, a short call: the GPU tests of the MoE launches (the shared expert inside them), the
# routed-expert tiles swept again (the other shapes' entries kept), the captured 35B step profiled,
# then `luce-tune generate` streaming from the real-shape file through the captured step with every
# expert in Q4_0 on the device (allow it 90 s: the load, the slots and the capture).
source "$(dirname "$0")/env.sh"
start_q35
t0=$(date +%s)
timeout ${TESTS_S:-90} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_moe_gate.py tests/engine/kernels/test_quant_matmul.py tests/engine/test_hybrid_quantized.py \
  -k "real_shapes_on_cuda or cuda_shared or cuda_quantized_moe or cuda_graph" > "$OUT/tests.log" 2>&1 \
  || echo "tests rc=$?"
echo "tests $(( $(date +%s) - t0 )) s"; grep -E "passed|failed" "$OUT/tests.log" | tail -1 || true
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -10 || true
timeout ${SWEEP_S:-60} python3 bench/quant_matmul.py --sweep --qtypes Q4_0 --sweep-shapes experts --warmup 3 --repeats 20 \
  --write-tuned engine/kernels/quant/tuned.json 2>&1 | tee "$OUT/tiles_sweep.log" | grep -v Warn | tail -3
cp engine/kernels/quant/tuned.json "$OUT/tuned.json" || true
[ -z "$maker" ] || wait $maker || echo "make-model failed"
timeout ${PROFILE_S:-80} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
  --steps 8 --rows 30 > "$OUT/profile.log" 2>&1 || echo "profile rc=$?"
grep -E "experts|static step|decode step" "$OUT/profile.log" | head -6 || true
timeout ${GENERATE_S:-90} python3 -m tuner.cli generate --model /tmp/q35.gguf --prompt "def fibonacci(n):" -n 128 \
  --weights quantized --expert-budget 30000 --cold-format quantized --hot-format quantized --cuda-graph \
  > "$OUT/generate.log" 2>&1 || echo "generate rc=$?"
tail -5 "$OUT/generate.log" | cut -c1-400
