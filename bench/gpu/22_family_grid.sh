#!/usr/bin/env bash
# Issue 7 on the H200: the study against the exhaustive coarse grid on the shipped family, in
# float32 (the family is small enough that bf16 buys nothing, and bf16 logits tie often
# enough to fail the greedy-identity constraint of DFlash trials: bench/dflash_lossless.py).
# A 4 MB budget step makes the budget a real dimension (the experts are ~19 MB).
source "$(dirname "$0")/env.sh"
sed -e 's#^dtype = .*#dtype = "float32"#' -e "s#models/#$PWD/models/#" appliance.toml > /tmp/family.toml
timeout ${FAMILY_S:-420} python3 bench/grid_vs_study.py --config /tmp/family.toml --trials ${TRIALS:-10} \
  --budget-points ${POINTS:-3} --budget-step-mb 4 --db "$OUT/grid_family.db" \
  --json "$OUT/grid_vs_study_family.json" > "$OUT/grid_family.log" 2>&1 || echo "family rc=$?"
grep -v "^\[I " "$OUT/grid_family.log" | tail -40
