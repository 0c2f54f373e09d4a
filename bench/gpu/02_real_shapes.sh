#!/usr/bin/env bash
# The 35B shapes (random Q4_0): speed figures, the six-point budget sweep, the MoE kernel tiles.
source "$(dirname "$0")/env.sh"
luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf
python3 bench/engine_bench.py --model /tmp/q35.gguf --prompt-lens 512,4096 --decode 32 --repeats 3 \
  --json "$OUT/bench35b.json" 2>&1 | tee "$OUT/bench35b.log"
python3 bench/budget_sweep.py --model /tmp/q35.gguf --points 0,10,25,50,75,100 --decode 16 --repeats 3 \
  --json "$OUT/sweep35b.json" 2>&1 | tee "$OUT/sweep35b.log"
python3 bench/moe_kernel.py --sweep --json "$OUT/moe_kernel.json" 2>&1 | tee "$OUT/moe_kernel.log"
