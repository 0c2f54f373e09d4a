#!/usr/bin/env bash
# The 35B shapes once more: decode eager against the captured CUDA graph (dense and quantized
# projections, every expert on the GPU), then the tuner study under the appliance's 24 GB cap
# now that a load with a budget keeps the cold experts off the GPU (issues 9, 3, 7).
source "$(dirname "$0")/env.sh"
luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
for w in dense quantized; do
  timeout ${BENCH_S:-120} python3 bench/engine_bench.py --model /tmp/q35.gguf --prompt-lens 512 --decode 32 --repeats 3 \
    --weights $w --json "$OUT/bench35b_$w.json" > "$OUT/bench35b_$w.log" 2>&1 || true
  tail -6 "$OUT/bench35b_$w.log"
done
sed -e 's#^target = .*#target = "/tmp/q35.gguf"#' -e 's#^drafts = .*#drafts = []#' -e 's#^drafter = .*#drafter = ""#' \
  -e 's#^vram_cap_mb = .*#vram_cap_mb = 24576#' appliance.toml > /tmp/q35.toml
timeout ${STUDY_S:-240} python3 -m tuner.cli run --config /tmp/q35.toml --trials ${TRIALS:-6} --timeout 150 \
  --storage "sqlite:///$OUT/q35.db" > "$OUT/run_q35.log" 2>&1 || true
tail -25 "$OUT/run_q35.log"
