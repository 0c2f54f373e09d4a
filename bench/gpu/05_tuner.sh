#!/usr/bin/env bash
# Two studies with live NVML telemetry: the shipped family, and the 35B shapes under the
# appliance's 24 GB card (issue 7's GPU acceptance).
source "$(dirname "$0")/env.sh"
luce run --trials 12 --timeout 240 --storage "sqlite:///$OUT/family.db" 2>&1 | tee "$OUT/run_family.log"
luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf
sed -e 's#^target = .*#target = "/tmp/q35.gguf"#' -e 's#^drafts = .*#drafts = []#' -e 's#^drafter = .*#drafter = ""#' \
  -e 's#^vram_cap_mb = .*#vram_cap_mb = 24576#' appliance.toml > /tmp/q35.toml
luce run --config /tmp/q35.toml --trials 8 --timeout 300 --storage "sqlite:///$OUT/q35.db" 2>&1 | tee "$OUT/run_q35.log"
