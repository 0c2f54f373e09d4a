#!/usr/bin/env bash
# Issue 4: the device loop's step in fewer launches (268 -> 205 counted on the CPU, bench/dflash_launches.py): the
# verify block's Gated DeltaNet states written after every token and copied at the kept one, against
# the replay of the kept tokens (`DecodeGraph(restore=...)`): the CUDA tests (the delta rule's per-token states at
# the shipped and 35B shapes, the captured rollbacks and the device loop's restore per way), the verify step and its
# restore alone per way (`bench/restore.py`: what writing the states costs, what copying them saves), the step bench
# with both and the device loop's lag at 1 and 2 (`bench/dflash_step.py --restores states,replay --lags 1,2`: does
# the step's `host` share shrink when the host launches two steps ahead?), then issue 4's table with the per-token
# states (`auto` picks them for the shipped target; `LAG`). DRAFT: the table's and the step's draft (default the
# 8192x960). Between them, the loop's Python per step with its launches stood in for (`bench/dflash_host.py`).
source "$(dirname "$0")/env.sh"
[ -f /tmp/corpus/held_out.txt ] || python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" \
  > "$OUT/corpus.log" 2>&1
DRAFT=${DRAFT:-bench/drafts/luce-draft-8192x960.gguf}
dflash_tests
mv "$OUT/tests.log" "$OUT/tests_gpu.log"
t0=$(date +%s)
# the draft's fused launches (the cache write with the keys' norm + RoPE, SwiGLU) on CUDA: unmarked tests that take
# the GPU where there is one
timeout ${DTESTS_S:-90} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/dflash/test_draft.py -k "in_cache or extension" "tests/engine/model/test_moe.py::test_swiglu_takes_the_kernel_where_the_fused_gate_applies" \
  > "$OUT/tests.log" 2>&1 || echo "draft tests rc=$?"
tests_summary $t0
timeout ${RESTORE_S:-60} python3 bench/restore.py --target models/luce-target.gguf --spec-lens 4,8,16 \
  --json "$OUT/restore.json" 2>&1 | grep -v Warn | tee "$OUT/restore.log" || echo "restore bench rc=$?"
timeout ${STEP_S:-150} python3 bench/dflash_step.py --target models/luce-target.gguf --draft "$DRAFT" \
  --corpus /tmp/corpus/held_out.txt --spec-lens ${STEP_SPECS:-4,16} --restores states,replay --lags ${LAGS:-1,2} \
  --json "$OUT/dflash_step_restores.json" 2>&1 | grep -v Warn | tee "$OUT/dflash_step_restores.log" \
  || echo "step bench rc=$?"
timeout ${HOST_S:-60} python3 bench/dflash_host.py --target models/luce-target.gguf --draft "$DRAFT" --device cuda \
  --spec-lens 4,16 --lags 1,2 --json "$OUT/dflash_host.json" 2>&1 | grep -v Warn || echo "host bench rc=$?"
timeout ${DFLASH_S:-300} python3 bench/dflash.py --target models/luce-target.gguf --draft "$DRAFT" \
  --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens ${SPECS:-4,8,16} --budgets ${BUDGETS:-all,50%} \
  --rollbacks capture --restores ${RESTORES:-auto} --lag ${LAG:-1} --cold-device gpu --long-form ${LONG:-2} --code ${CODE:-2} \
  --new-tokens 400 --fallbacks 0 --json "$OUT/dflash_table.json" 2>&1 | grep -v Warn | tee "$OUT/dflash_table.log" \
  | tail -16 || echo "table rc=$?"
