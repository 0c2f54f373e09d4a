#!/usr/bin/env bash
# Issue 4's losslessness check on the H200, then issue 7's study against the exhaustive grid on
# the shipped family. The check runs greedy DFlash against a plain-decoded shadow state in bf16
# and float32 (eager verify with both rollbacks, graph verify), and once in bf16 with short
# Gated DeltaNet calls sent back to fla (the behaviour before the Triton short kernel). Prompts
# are windows of a file of this repository, the same here and on the CPU. The grid then runs
# with a 4 MB budget step (the family's experts are ~19 MB: budgets 0, 8 and 20 MB).
source "$(dirname "$0")/env.sh"
CORPUS=${CORPUS:-engine/dflash/speculative.py}
check() {
  timeout ${CHECK_S:-100} python3 bench/dflash_lossless.py --target models/luce-target.gguf \
    --draft ${DRAFT:-models/luce-draft.gguf} --spec-lens 4,8 --prompts 2 --new-tokens 96 \
    --prompt-tokens 192 --corpus "$CORPUS" "$@" 2>&1 | grep -v Warn || echo "check rc=$?"
}
check --dtype bfloat16 --verify-paths eager,graph
check --dtype float32 --verify-paths eager,graph
check --dtype bfloat16 --verify-paths eager --rollbacks capture --short-kernel off
timeout ${FAMILY_S:-330} python3 bench/grid_vs_study.py --config appliance.toml --trials ${TRIALS:-10} \
  --budget-points ${POINTS:-3} --budget-step-mb 4 --db "$OUT/grid_family.db" \
  --json "$OUT/grid_vs_study_family.json" 2>&1 | grep -v "^\[I " | tail -30 || echo "family rc=$?"
