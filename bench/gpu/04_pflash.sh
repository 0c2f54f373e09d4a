#!/usr/bin/env bash
# NIAH accuracy and TTFT with and without PFlash at 4K/8K/16K, at two expert budgets (issue 5).
source "$(dirname "$0")/env.sh"
python3 bench/pflash.py --target models/luce-target.gguf --drafter models/luce-drafter.gguf \
  --contexts 4096,8192,16384 --ratios 0.05,0.1,0.2,0.3 --cases 20 --budgets all,50% \
  --json "$OUT/pflash.json" 2>&1 | tee "$OUT/pflash.log"
