#!/usr/bin/env bash
# One call, two issues. Issue 4: a DFlash step's graphs timed again with the shipped draft (whole
# blocks verified to the end now, every restore captured before the loop), then issue 4's table with
# pure speculation and with plain stretches and re-tries (FALLBACKS). Issue 9: the captured 35B step
# with the split-key attention at 64, 128 and 256 keys per program, at depth 16 and 16,384.
source "$(dirname "$0")/env.sh"
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
t0=$(date +%s)
timeout ${STEP_S:-80} python3 bench/dflash_step.py --target models/luce-target.gguf --draft models/luce-draft.gguf \
  --corpus /tmp/corpus/held_out.txt --json "$OUT/dflash_step.json" 2>&1 | grep -v Warn || echo "step bench rc=$?"
timeout ${DFLASH_S:-170} python3 bench/dflash.py --target models/luce-target.gguf --draft models/luce-draft.gguf \
  --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens 4,8,16 --budgets all,50% \
  --rollbacks capture --cold-device gpu --long-form 2 --code 2 --new-tokens 400 --fallbacks ${FALLBACKS:-0,1.2} \
  --json "$OUT/dflash_table.json" 2>&1 | grep -v Warn > "$OUT/dflash_table.log" || echo "table rc=$?"
sed -n '/^summary/,$p' "$OUT/dflash_table.log" | cut -c1-120
echo "issue 4 part $(( $(date +%s) - t0 )) s"
t1=$(date +%s)
timeout ${MAKE_S:-70} python3 -m tuner.cli make-model --preset qwen3.6-35b-a3b --quant q4_0 -o /tmp/q35.gguf \
  > "$OUT/make.log" 2>&1 || echo "make-model rc=$?"
echo "make-model $(( $(date +%s) - t1 )) s"
for depth in 16 16384; do
  timeout ${PROFILE_S:-110} python3 bench/profile_decode.py --model /tmp/q35.gguf --weights quantized --experts quantized \
    --steps 8 --rows 30 --depth $depth --attention-chunks 64,128,256 > "$OUT/profile_depth$depth.log" 2>&1 \
    || echo "profile depth $depth rc=$?"
  grep -E "attention chunk|static step|decode step" "$OUT/profile_depth$depth.log" | head -6 || true
done
