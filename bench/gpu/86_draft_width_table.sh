#!/usr/bin/env bash
# Issue 4, right after 85 on the warm machine: waits for its draft (WAIT_S), copies it, its report and log to
# $OUT, runs issue 4's table with it (81's settings: float32, graph verify, spec_len 4/8/16, all and 50% of the
# experts, 2 long-form and 2 code prompts, 400 new tokens), then the first drafted slot's hit rates on held-out
# prompts for it and for the 8192x960 draft (bench/draft_rows.py, ROWS_S each).
source "$(dirname "$0")/env.sh"
t0=$(date +%s)
while pgrep -f "tuner.cli train-draft" > /dev/null && [ $(( $(date +%s) - t0 )) -lt ${WAIT_S:-420} ]; do sleep 5; done
echo "waited $(( $(date +%s) - t0 )) s for the draft"
tail -c 3000 /tmp/draft/train.log | tr '\r' '\n' | grep -v "^$" | tail -10 || true
cp /tmp/draft/luce-draft.gguf /tmp/draft/luce-draft.acceptance.json /tmp/draft/train.log "$OUT"/ 2>/dev/null || true
timeout ${DFLASH_S:-240} python3 bench/dflash.py --target models/luce-target.gguf --draft /tmp/draft/luce-draft.gguf \
  --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens ${SPECS:-4,8,16} --budgets ${BUDGETS:-all,50%} \
  --rollbacks capture --restores auto --cold-device gpu --long-form ${LONG:-2} --code ${CODE:-2} \
  --new-tokens 400 --fallbacks 0 --json "$OUT/dflash_table.json" 2>&1 | grep -v Warn | tee "$OUT/dflash_table.log" \
  | tail -16 || echo "table rc=$?"
first_slot_rows /tmp/draft/luce-draft.gguf bench/drafts/luce-draft-8192x960.gguf
