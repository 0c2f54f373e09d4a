#!/usr/bin/env bash
# Issue 7's comparison on the H200: the study against the exhaustive coarse grid (budget x draft x
# spec_len x keep ratio), first on the shipped family (the embedded default; with a GPU the budget
# joins the space), then the same on the 35B shapes under the 24 GB cap with Q4_0 experts and
# graph decoding when GRID35=1 (the grid there is larger: allow a call of its own).
source "$(dirname "$0")/env.sh"
timeout ${FAMILY_S:-270} python3 bench/grid_vs_study.py --config appliance.toml --trials ${TRIALS:-12} \
  --budget-points ${POINTS:-4} --json "$OUT/grid_vs_study_family.json" 2>&1 | tail -25 || echo "family rc=$?"
if [ "${GRID35:-0}" = 1 ]; then
  [ -f /tmp/q35.gguf ] || luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf > "$OUT/make.log" 2>&1
  sed -e 's#^target = .*#target = "/tmp/q35.gguf"#' -e 's#^drafts = .*#drafts = []#' -e 's#^drafter = .*#drafter = ""#' \
    -e 's#^vram_cap_mb = .*#vram_cap_mb = 24576#' -e 's#^weights = .*#weights = "quantized"#' \
    -e 's#^experts = .*#experts = "quantized"#' -e 's#^cuda_graph = .*#cuda_graph = true#' appliance.toml > /tmp/q35.toml
  timeout ${GRID35_S:-300} python3 bench/grid_vs_study.py --config /tmp/q35.toml --trials ${TRIALS:-8} \
    --budget-points ${POINTS:-4} --json "$OUT/grid_vs_study_q35.json" 2>&1 | tail -25 || echo "q35 rc=$?"
fi
