#!/usr/bin/env bash
# Issue 7 on the 35B shapes: the study against the exhaustive coarse grid under the appliance's
# 24 GB cap, with the experts in their Q4_0 blocks on both tiers (budgets in quantized bytes) and
# graph decoding where every expert is on the GPU. The workload is cut down so that a trial
# with every expert on the CPU fits its time box: one code and one long-form prompt of 128
# tokens, 16 new tokens, one warm-up and two repeats.
source "$(dirname "$0")/env.sh"
[ -f /tmp/q35.gguf ] || { t0=$(date +%s); luce make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf \
  > "$OUT/make.log" 2>&1; echo "make-model $(( $(date +%s) - t0 )) s"; }
sed -e 's#^target = .*#target = "/tmp/q35.gguf"#' -e 's#^drafts = .*#drafts = []#' -e 's#^drafter = .*#drafter = ""#' \
  -e 's#^vram_cap_mb = .*#vram_cap_mb = 24576#' -e 's#^weights = .*#weights = "quantized"#' \
  -e 's#^experts = .*#experts = "quantized"#' -e 's#^cuda_graph = .*#cuda_graph = true#' \
  -e 's#^long_prompt_tokens = .*#long_prompt_tokens = 128#' -e 's#^max_new_tokens = .*#max_new_tokens = 16#' \
  -e 's#^repeats = .*#repeats = 2#' -e 's#^trial_timeout_s = .*#trial_timeout_s = 200#' \
  -e 's#^load_timeout_s = .*#load_timeout_s = 200#' -e 's#^niah_cases = .*#niah_cases = 0#' appliance.toml > /tmp/q35.toml
timeout ${GRID35_S:-500} python3 bench/grid_vs_study.py --config /tmp/q35.toml --trials ${TRIALS:-6} \
  --budget-points ${POINTS:-3} --db "$OUT/grid_q35.db" --json "$OUT/grid_vs_study_q35.json" 2>&1 \
  | grep -v "^\[I " | tail -30 || echo "q35 rc=$?"
