#!/usr/bin/env bash
# Issue 4, one call: a draft reading the target's last layer (LAYER_IDS, default 1,4,7: the shipped draft
# reads 1,3,5 of the 8) trained with the shipped draft's recipe (36_draft_run.sh: 4,096 distilled rows of
# 512 + 448 tokens, 3,072 steps of 16 rows x 256 anchors, held-out prompts of 512 tokens), its report and
# files to $OUT, then issue 4's table with it at the all-GPU budget (SPECS, LONG, CODE) in what is left.
here=$(dirname "$0")
LAYER_IDS=${LAYER_IDS:-1,4,7} DISTILL_N=${DISTILL_N:-4096} DISTILL_PROMPT=512 DISTILL_NEW=448 EVAL_PROMPT=512 \
  DISTILL_BATCH=${DISTILL_BATCH:-1024} TESTS_S=1 BF16_S=1 WAIT_S=${WAIT_S:-470} bash "$here/36_draft_run.sh"
source "$here/env.sh"
[ -f /tmp/draft/luce-draft.gguf ] || { echo "no draft"; exit 1; }
timeout ${DFLASH_S:-100} python3 bench/dflash.py --target models/luce-target.gguf --draft /tmp/draft/luce-draft.gguf \
  --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens ${SPECS:-8,16} --budgets all \
  --rollbacks capture --cold-device gpu --long-form ${LONG:-2} --code ${CODE:-2} --new-tokens 400 --fallbacks 0 \
  --json "$OUT/dflash_table.json" 2>&1 | grep -v Warn | tee "$OUT/dflash_table.log" | tail -8 || echo "table rc=$?"
