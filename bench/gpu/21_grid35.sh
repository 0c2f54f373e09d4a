#!/usr/bin/env bash
# Issue 7 on the 35B shapes: the study against the exhaustive coarse grid under the appliance's
# 24 GB cap, with the experts in their Q4_0 blocks on both tiers (budgets in quantized bytes) and
# graph decoding where every expert is on the GPU. The workload is cut down so that a trial
# with every expert on the CPU fits its time box: one code and one long-form prompt of 128
# tokens, 16 new tokens, one warm-up and two repeats.
# COLD_DEVICE=gpu: the experts outside the budget computed by the GPU from pinned host memory (captured in the graph).
source "$(dirname "$0")/env.sh"
capped35_toml /tmp/q35.toml -e "s#^cold_device = .*#cold_device = \"${COLD_DEVICE:-cpu}\"#"
timeout ${GRID35_S:-500} python3 bench/grid_vs_study.py --config /tmp/q35.toml --trials ${TRIALS:-6} \
  --budget-points ${POINTS:-3} --db "$OUT/grid_q35.db" --json "$OUT/grid_vs_study_q35.json" 2>&1 \
  | grep -v "^\[I " | tail -30 || echo "q35 rc=$?"
