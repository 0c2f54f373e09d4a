#!/usr/bin/env bash
# Quantized weights and the GDN decode kernel on CUDA (issue 9): the kernel tests, the kernels against their bandwidth
# floor, and the 35B shapes with projections kept as Q4_0 blocks against the dequantized engine.
source "$(dirname "$0")/env.sh"
timeout 240 python3 -m pytest -m gpu -q --tb=short -rf -p no:cacheprovider tests/engine/kernels/test_quant_matmul.py \
  tests/engine/model/test_quantized_weights.py tests/engine/kernels/test_cpu_quant.py \
  tests/engine/test_hybrid_quantized.py tests/engine/kernels/test_gdn_decode.py > "$OUT/quant_tests.log" 2>&1 || true
tail -15 "$OUT/quant_tests.log"
python3 bench/quant_matmul.py --json "$OUT/quant_matmul.json" 2>&1 | tee "$OUT/quant_matmul.log"
python3 bench/gdn_decode.py --sweep --json "$OUT/gdn_decode.json" 2>&1 | tee "$OUT/gdn_decode.log"
luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf
for w in dense quantized; do
  python3 bench/engine_bench.py --model /tmp/q35.gguf --prompt-lens 512 --decode 16 --repeats 3 --weights $w \
    --json "$OUT/bench35b_$w.json" 2>&1 | tee "$OUT/bench35b_$w.log"
done
