#!/usr/bin/env bash
# Issue 4: the verify blocks of spec_len 8 and 16 (9 and 17 float32 rows) through the few-row kernel
# (`LUCE_TUNE_FEW_ROWS=18`) against the `tl.dot` kernel they take by default. The fifteenth round's table: a verify
# block cost 0.51 ms at spec_len 8 against 0.33 at spec_len 4. bench/few_rows.py times each way in CUDA graphs at 9
# and 17 rows (ROWS) and the tiles in TILES; the skinny CUDA tests (TESTS_S; 0 skips them); then the DFlash step at
# spec_len 8 and 16 (bench/dflash_step.py, STEP_S a process) and issue 4's table at spec_len SPECS (8,16) on LONG
# long-form and CODE code prompts (DFLASH_S a process), each with FEW_ROWS in turn (default "8 18": the shipped
# bound, then 9-17 rows through the few-row kernel at the best-ranked tile). TARGET and DRAFT pick the models
# (default the shipped target and bench/drafts/luce-draft-8192x960.gguf), LOOKUPS and FALLBACKS the table's rows.
source "$(dirname "$0")/env.sh"
[ -f /tmp/corpus/held_out.txt ] || python3 -c \
  "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > "$OUT/corpus.log" 2>&1 &
timeout ${ROWS_S:-120} python3 bench/few_rows.py --rows ${ROWS:-9,17} --tiles "${TILES:-2,256,1;4,256,1;4,256,2;8,256,2}" \
  --json "$OUT/few_rows_nine.json" 2>&1 | grep -v Warn | tee "$OUT/few_rows_nine.log" || echo "few rows rc=$?"
wait
tile=$(python3 -c "import json; print(','.join(map(str, json.load(open('$OUT/few_rows_nine.json'))['tiles_ranked'][0][0])))" \
  2>/dev/null || echo 2,256,1)
export LUCE_TUNE_ROWS_TILE=${TILE:-$tile}
echo "tile $LUCE_TUNE_ROWS_TILE"
if [ "${TESTS_S:-60}" != 0 ]; then
  t0=$(date +%s)
  timeout ${TESTS_S:-60} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
    tests/engine/kernels/test_skinny.py -k "cuda" > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
  tests_summary $t0
  mv "$OUT/tests.log" "$OUT/tests_skinny.log"
fi
DRAFT=${DRAFT:-bench/drafts/luce-draft-8192x960.gguf}
for few in ${FEW_ROWS:-8 18}; do
  LUCE_TUNE_FEW_ROWS=$few timeout ${STEP_S:-90} python3 bench/dflash_step.py \
    --target ${TARGET:-models/luce-target.gguf} --draft "$DRAFT" --corpus /tmp/corpus/held_out.txt \
    --spec-lens ${STEP_SPECS:-8,16} --restores states \
    --json "$OUT/step_few$few.json" 2>&1 | grep -v Warn | tail -6 | sed "s/^/few rows $few: /" || echo "step rc=$?"
done
for few in ${FEW_ROWS:-8 18}; do
  LUCE_TUNE_FEW_ROWS=$few timeout ${DFLASH_S:-150} python3 bench/dflash.py --target ${TARGET:-models/luce-target.gguf} \
    --draft "$DRAFT" --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens ${SPECS:-8,16} \
    --budgets ${BUDGETS:-all} --rollbacks capture --restores auto --cold-device gpu --long-form ${LONG:-2} \
    --code ${CODE:-2} --new-tokens 400 --fallbacks ${FALLBACKS:-0} --lookups ${LOOKUPS:-0} --json "$OUT/table_few$few.json" 2>&1 | grep -v Warn \
    > "$OUT/table_few$few.log" || echo "table rc=$?"
  echo "== few rows $few"; grep -A6 "^summary" "$OUT/table_few$few.log" || tail -3 "$OUT/table_few$few.log"
done
