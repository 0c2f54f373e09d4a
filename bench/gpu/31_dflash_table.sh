#!/usr/bin/env bash
# Issue 4, second call on the warm machine after 30_dflash_step_draft.sh: waits for its draft, copies it
# to $OUT, times a DFlash step's graphs with the shipped and the new draft (bench/dflash_step.py), then
# issue 4's table with the new draft: pure speculation and, with FALLBACKS=0,1.2, plain stretches
# with re-tries; LOOKUPS=0,3 adds rows with the committed-text lookup. STEP_DRAFTS: the drafts whose
# step is timed (default both); TARGET: the target (default models/luce-target.gguf).
source "$(dirname "$0")/env.sh"
t0=$(date +%s)
while pgrep -f "tuner.cli train-draft" > /dev/null && [ $(( $(date +%s) - t0 )) -lt ${WAIT_S:-300} ]; do sleep 5; done
echo "waited $(( $(date +%s) - t0 )) s for the draft"; tail -c 1500 /tmp/draft/train.log | tr '\r' '\n' | grep -v "^$" | tail -6 || true
cp /tmp/draft/luce-draft.gguf /tmp/draft/luce-draft.acceptance.json /tmp/draft/train.log "$OUT"/ 2>/dev/null || true
for d in ${STEP_DRAFTS:-models/luce-draft.gguf /tmp/draft/luce-draft.gguf}; do
  [ -f "$d" ] || continue
  timeout ${STEP_S:-100} python3 bench/dflash_step.py --target ${TARGET:-models/luce-target.gguf} --draft "$d" \
    --corpus /tmp/corpus/held_out.txt --json "$OUT/dflash_step_$(basename $(dirname $d)).json" 2>&1 | grep -v Warn \
    || echo "step bench rc=$?"
done
DRAFT=/tmp/draft/luce-draft.gguf
[ -f "$DRAFT" ] || DRAFT=models/luce-draft.gguf
timeout ${DFLASH_S:-300} python3 bench/dflash.py --target ${TARGET:-models/luce-target.gguf} --draft $DRAFT \
  --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens ${SPECS:-4,8,16} --budgets ${BUDGETS:-all,50%} \
  --rollbacks capture --cold-device gpu --long-form ${LONG:-2} --code ${CODE:-2} --new-tokens 400 \
  --fallbacks ${FALLBACKS:-0} --lookups ${LOOKUPS:-0} --json "$OUT/dflash_table.json" 2>&1 | grep -v Warn | tee "$OUT/dflash_table.log" | tail -16 \
  || echo "table rc=$?"
