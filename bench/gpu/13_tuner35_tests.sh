#!/usr/bin/env bash
# The tuner study on the 35B shapes under the appliance's 24 GB cap, the experts in their Q4_0
# blocks on both tiers (budgets in quantized bytes) and graph decoding (issue 7), then the DFlash
# GPU tests (issue 4).
source "$(dirname "$0")/env.sh"
[ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
sed -e 's#^target = .*#target = "/tmp/q35.gguf"#' -e 's#^drafts = .*#drafts = []#' -e 's#^drafter = .*#drafter = ""#' \
  -e 's#^vram_cap_mb = .*#vram_cap_mb = 24576#' -e 's#^weights = .*#weights = "quantized"#' \
  -e 's#^experts = .*#experts = "quantized"#' -e 's#^cuda_graph = .*#cuda_graph = true#' appliance.toml > /tmp/q35.toml
timeout ${STUDY_S:-300} python3 -m tuner.cli run --config /tmp/q35.toml --trials ${TRIALS:-6} --timeout 150 \
  --storage "sqlite:///$OUT/q35.db" > "$OUT/run_q35.log" 2>&1 || echo "study rc=$?"
tail -30 "$OUT/run_q35.log"
FILES="tests/engine/dflash/test_gpu.py" FILE_S=${FILE_S:-200} bash "$(dirname "$0")/10_tests_per_file.sh"
