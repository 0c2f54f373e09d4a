#!/usr/bin/env bash
# Issue 4, after 88: issue 4's table with the shipped default (2-7 rows through the few-row kernel): spec_len
# SPECS (4,8,16) at BUDGETS (all), the 8192 x 960 draft, LONG long-form and CODE HumanEval prompts (DFLASH_S);
# then the few-row kernel at one row (the plain decode step's GEMV) and at 9 and 17 rows (verify blocks at spec_len
# 8 and 16, now through the tl.dot kernel) at three tiles (bench/few_rows.py, ROWS_S).
source "$(dirname "$0")/env.sh"
STEP_DRAFTS=none DRAFT=${DRAFT:-bench/drafts/luce-draft-8192x960.gguf} LONG=${LONG:-4} CODE=${CODE:-2} \
  SPECS=${SPECS:-4,8,16} BUDGETS=${BUDGETS:-all} DFLASH_S=${DFLASH_S:-200} bash "$(dirname "$0")/44_dflash_table_49152.sh"
timeout ${ROWS_S:-90} python3 bench/few_rows.py --rows ${ROWS:-1,9,17} --tiles "${TILES:-2,256,1;4,256,1;8,256,2}" \
  --json "$OUT/few_rows_more.json" 2>&1 | grep -v Warn | tee "$OUT/few_rows_more.log" || echo "few rows rc=$?"
