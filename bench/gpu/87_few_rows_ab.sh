#!/usr/bin/env bash
# Issue 4: the float32 projections of 2-7 rows (a verify block at spec_len 4, a draft block of 4) through the
# skinny kernel's form without tl.dot (`engine.kernels.skinny._skinny_kernel`, DOT=False) against cuBLAS, whose
# split-K GEMM takes two launches for them where a one-row call takes one GEMV. The skinny CUDA tests (both forms,
# eager and in a CUDA graph, at the shipped models' shapes), then per LUCE_TUNE_SKINNY_MIN_ROWS in MIN_ROWS
# (default "8 2 1": cuBLAS below 8 rows as shipped, the new form from 2 rows, and from 1 row, which moves the plain
# step too) in alternating processes (PAIRS rounds): the DFlash step's parts and the plain step
# (bench/dflash_step.py, spec_len STEP_SPECS, default 4), then issue 4's table at spec_len 4 on LONG long-form and
# CODE code prompts (default 6 and 2, all experts on the GPU, DFLASH_S a process). Whichever is faster becomes
# skinny_min_rows's default.
source "$(dirname "$0")/env.sh"
[ -f /tmp/corpus/held_out.txt ] || python3 -c \
  "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > "$OUT/corpus.log" 2>&1
DRAFT=${DRAFT:-bench/drafts/luce-draft-8192x960.gguf}
t0=$(date +%s)
timeout ${TESTS_S:-120} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/kernels/test_skinny.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
tests_summary $t0
mv "$OUT/tests.log" "$OUT/tests_skinny.log"
for round in $(seq ${PAIRS:-2}); do
  for rows in ${MIN_ROWS:-8 2 1}; do
    LUCE_TUNE_SKINNY_MIN_ROWS=$rows timeout ${STEP_S:-90} python3 bench/dflash_step.py \
      --target models/luce-target.gguf --draft "$DRAFT" --corpus /tmp/corpus/held_out.txt \
      --spec-lens ${STEP_SPECS:-4} --restores states \
      --json "$OUT/step_rows${rows}_$round.json" 2>&1 | grep -v Warn | tail -4 | sed "s/^/rows $rows: /" \
      || echo "step rows $rows rc=$?"
  done
done
for rows in ${MIN_ROWS:-8 2 1}; do
  LUCE_TUNE_SKINNY_MIN_ROWS=$rows timeout ${DFLASH_S:-120} python3 bench/dflash.py --target models/luce-target.gguf \
    --draft "$DRAFT" --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens 4 --budgets all \
    --rollbacks capture --restores auto --cold-device gpu --long-form ${LONG:-6} --code ${CODE:-2} --new-tokens 400 \
    --fallbacks 0 --json "$OUT/table_rows$rows.json" 2>&1 | grep -v Warn > "$OUT/table_rows$rows.log" \
    || echo "table rc=$?"
  echo "== min rows $rows"; grep -A4 "^summary" "$OUT/table_rows$rows.log" || tail -3 "$OUT/table_rows$rows.log"
done
