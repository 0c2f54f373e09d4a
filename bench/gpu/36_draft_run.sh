#!/usr/bin/env bash
# Issue 4: a draft trained in the background on many distinct distilled prompts for few epochs
# (default 16,384 x 96 new tokens, 3,072 steps of 16 rows: 3 epochs; drafts shown their rows more
# often learned them rather than the target), the target's passes batched per step through the
# fused-MoE executor, while GPU tests run beside it (TESTS_K: by default the batched passes, the
# training passes and the captured bf16 step) and the bf16 gap is measured again; then waits for the
# draft and copies it, its log and its held-out acceptance report to $OUT. On a warm machine remove
# /tmp/draft first (an old checkpoint there is refused). 31_dflash_table.sh runs the table with it next.
# DISTILL_PROMPT sets the prompt tokens of each distilled row and EVAL_PROMPT the held-out prompts' length:
# drafts accept less past the context lengths they trained on (docs/benchmarks.md), and issue 4's table
# continues prompts of 512 (for it: DISTILL_PROMPT=512 DISTILL_NEW=448 EVAL_PROMPT=512, fewer rows).
# LAYER_IDS (for example 1,4,7) picks the target layers the draft reads instead of --features' spacing.
# TARGET: the target the draft is trained for (default models/luce-target.gguf).
source "$(dirname "$0")/env.sh"
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
mkdir -p /tmp/draft
t0=$(date +%s)
setsid nohup python3 -m tuner.cli train-draft --target ${TARGET:-models/luce-target.gguf} --corpus /tmp/corpus/train.txt \
  --out /tmp/draft/luce-draft.gguf --layers 3 --features 3 ${LAYER_IDS:+--layer-ids $LAYER_IDS} --block-size 16 --batch 16 --anchors 256 --lr 2e-3 \
  --distill ${DISTILL_N:-16384} --distill-prompt ${DISTILL_PROMPT:-64} --distill-new ${DISTILL_NEW:-96} \
  --distill-batch ${DISTILL_BATCH:-1024} --eval-prompt-tokens ${EVAL_PROMPT:-128} \
  --steps ${DRAFT_STEPS:-3072} --time-budget ${DRAFT_MINUTES:-6}m ${HELD_OUT:+--held-out $HELD_OUT} --device cuda \
  > /tmp/draft/train.log 2>&1 &
echo "draft training started"
timeout ${TESTS_S:-200} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/dflash/test_gpu.py tests/engine/model/test_decode_graph.py \
  -k "${TESTS_K:-batched or training_passes or stays_as_close or matches_eager_bf16}" \
  > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
grep -E "passed|failed|^FAILED|^E " "$OUT/tests.log" | tail -8 || true
timeout ${BF16_S:-90} python3 bench/bf16_static_vs_eager.py > "$OUT/bf16_static_vs_eager.log" 2>&1 || echo "bf16 rc=$?"
grep -v Warn "$OUT/bf16_static_vs_eager.log" | tail -6 || true
while pgrep -f "tuner.cli train-draft" > /dev/null && [ $(( $(date +%s) - t0 )) -lt ${WAIT_S:-540} ]; do sleep 5; done
echo "draft run $(( $(date +%s) - t0 )) s"
tail -c 2000 /tmp/draft/train.log | tr '\r' '\n' | grep -v "^$" | tail -8 || true
cp /tmp/draft/luce-draft.gguf /tmp/draft/luce-draft.acceptance.json /tmp/draft/train.log "$OUT"/ 2>/dev/null || true
