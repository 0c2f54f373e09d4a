#!/usr/bin/env bash
# A matched DFlash draft for the shipped target, trained on the GPU, then its speed-ups at two
# expert budgets on long-form and code prompts (issue 4's acceptance figures). With PFLASH=1
# the PFlash benchmark (04_pflash.sh) follows in the same call.
source "$(dirname "$0")/env.sh"
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)"
# Self-distilled rows: corpus prompts of 64 tokens, each continued greedily (generate batches in
# bf16), anchors in the generated part. 1,024 x 448 (70 s to generate) gave a draft that accepts
# 6.7 tokens teacher-forced on its own rows and 1.2-1.3 on held-out windows: it learned the
# target's loops on those prompts. The default is now 6,144 prompts x 160 tokens (about as many
# tokens, six times the distinct prompts). Each sequence goes through the
# engine's target once (the first epoch, 64 steps of 16 rows, ~70 ms a pass); later steps run
# the draft only; 4 min of training leaves the speed-up stage its 200 s within one call.
# Long continuations give more rows per target pass: on the CPU, 64-256
# sequences reused for many epochs were memorised (docs/benchmarks.md).
luce train-draft --target models/luce-target.gguf --corpus /tmp/corpus/train.txt --out "$OUT/luce-draft.gguf" \
  --layers 3 --features 3 --block-size 16 --batch 16 --anchors 256 --lr 2e-3 \
  --distill ${DISTILL_N:-6144} --distill-prompt 64 --distill-new ${DISTILL_NEW:-160} --distill-batch 1024 \
  --steps ${DRAFT_STEPS:-1500} --time-budget ${DRAFT_MINUTES:-4}m --device cuda 2>&1 | tee "$OUT/train_draft.log"
rm -rf "$OUT"/luce-draft.gguf.ckpt* "$OUT"/luce-draft.gguf.distill.pt
timeout ${DFLASH_S:-200} python3 bench/dflash.py --target models/luce-target.gguf --draft "$OUT/luce-draft.gguf" \
  --corpus /tmp/corpus/held_out.txt --spec-lens 4,8,16 --budgets all,50% --long-form 3 --code 3 \
  --new-tokens 400 ${GRAPH:+--graph} --json "$OUT/dflash.json" 2>&1 | tee "$OUT/dflash.log" || true
if [ "${PFLASH:-0}" = 1 ]; then
  bash "$(dirname "$0")/04_pflash.sh"
fi
