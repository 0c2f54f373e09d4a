#!/usr/bin/env bash
# Issue 7 on the H200: the study against the exhaustive coarse grid on the shipped family, in
# float32 (the family is small enough that bf16 buys nothing, and bf16 logits tie often
# enough to fail the greedy-identity constraint of DFlash trials: bench/dflash_lossless.py).
# A 4 MB budget step makes the budget a real dimension (the float32 experts are 48 MB: budgets
# 0, 24 and 48 MB). Graph decoding is on (CUDA_GRAPH=0 turns it off): eager decoding of a model
# this small is launch-bound on the GPU (27 tok/s in the first run, slower than this CPU), and
# 8 new tokens measured the same point 21.6 and 27.0 tok/s in two runs. With graph decoding and 32
# new tokens, points with a PFlash keep ratio decoded eagerly (129-214 tok/s against 1,297 for the
# same budget without one; the engine now decodes from the graph after a compressed prefill too):
# 256 new tokens by default (MAX_NEW).
# The grid took 5.5 min there and the study's first trial 2.3 min (cold Triton caches): give
# the script a call of its own. With ONLY=grid or ONLY=study and DB=path, one part per call.
# COLD_DEVICE=gpu has the GPU compute the experts outside the budget from pinned host memory, so
# that every budget decodes from the captured step (with the CPU tier, budget 0 decodes eagerly at
# about 25 tok/s, and 256 new tokens per generation do not fit a call).
source "$(dirname "$0")/env.sh"
graph=$([ "${CUDA_GRAPH:-1}" = 1 ] && echo true || echo false)
sed -e 's#^dtype = .*#dtype = "float32"#' -e "s#models/#$PWD/models/#" -e "s#^cuda_graph = .*#cuda_graph = $graph#" \
  -e "s#^max_new_tokens = .*#max_new_tokens = ${MAX_NEW:-256}#" -e "s#^cold_device = .*#cold_device = \"${COLD_DEVICE:-cpu}\"#" \
  appliance.toml > /tmp/family.toml
timeout ${FAMILY_S:-560} python3 bench/grid_vs_study.py --config /tmp/family.toml --trials ${TRIALS:-10} \
  --budget-points ${POINTS:-3} --budget-step-mb 4 --db "${DB:-$OUT/grid_family.db}" ${ONLY:+--only $ONLY} \
  --json "$OUT/grid_vs_study_family.json" > "$OUT/grid_family.log" 2>&1 || echo "family rc=$?"
grep -v "^\[I " "$OUT/grid_family.log" | tail -40
