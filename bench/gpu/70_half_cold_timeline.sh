#!/usr/bin/env bash
# Where the half-cold captured step goes: the Q4_0 35B file at half the experts (cold ones read over the bus,
# `--cold-device gpu`), the captured step's kernels in device order (`bench/profile_decode.py --timeline`) with
# no CPU share and with SHARE of the cold experts on the CPU threads (the collect launch's time is the wait
# for them). No other work beside it.
source "$(dirname "$0")/env.sh"
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
for share in 0 ${SHARE:-0.8}; do
  LUCE_TUNE_COLD_CPU_SHARE=$share timeout ${PROFILE_S:-150} python3 bench/profile_decode.py --model /tmp/q35.gguf \
    --weights quantized --experts quantized --budget-percent 50 --cold-device gpu --no-eager --timeline \
    --steps 16 --rows 40 > "$OUT/timeline_share$share.log" 2>&1 || echo "share $share rc=$?"
  grep -iE "step|median|idle|collect|publish|gather|moe" "$OUT/timeline_share$share.log" | head -30 || true
done
