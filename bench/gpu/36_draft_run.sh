#!/usr/bin/env bash
# Issue 4: a draft trained on 4x more distilled prompts (4,096 x 256 new tokens) with the target's
# passes through the fused-MoE executor, in the background, while the GPU tests owed from the last
# notes run beside it (the training passes against the reference executor, the captured bf16 step
# held to float32) and the bf16 gap is measured again; then waits for the draft and copies it, its
# log and its held-out acceptance report to $OUT. 31_dflash_table.sh runs the table with it next.
source "$(dirname "$0")/env.sh"
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
mkdir -p /tmp/draft
t0=$(date +%s)
setsid nohup python3 -m tuner.cli train-draft --target models/luce-target.gguf --corpus /tmp/corpus/train.txt \
  --out /tmp/draft/luce-draft.gguf --layers 3 --features 3 --block-size 16 --batch 16 --anchors 256 --lr 2e-3 \
  --distill ${DISTILL_N:-4096} --distill-prompt 64 --distill-new ${DISTILL_NEW:-256} --distill-batch 1024 \
  --steps ${DRAFT_STEPS:-3000} --time-budget ${DRAFT_MINUTES:-6}m --device cuda > /tmp/draft/train.log 2>&1 &
echo "draft training started"
timeout ${TESTS_S:-200} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/dflash/test_gpu.py tests/engine/model/test_decode_graph.py -k "training_passes or stays_as_close or matches_eager_bf16" \
  > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
grep -E "passed|failed|^FAILED|^E " "$OUT/tests.log" | tail -8 || true
timeout ${BF16_S:-90} python3 bench/bf16_static_vs_eager.py > "$OUT/bf16_static_vs_eager.log" 2>&1 || echo "bf16 rc=$?"
grep -v Warn "$OUT/bf16_static_vs_eager.log" | tail -6 || true
while pgrep -f "tuner.cli train-draft" > /dev/null && [ $(( $(date +%s) - t0 )) -lt ${WAIT_S:-540} ]; do sleep 5; done
echo "draft run $(( $(date +%s) - t0 )) s"
tail -c 2000 /tmp/draft/train.log | tr '\r' '\n' | grep -v "^$" | tail -8 || true
cp /tmp/draft/luce-draft.gguf /tmp/draft/luce-draft.acceptance.json /tmp/draft/train.log "$OUT"/ 2>/dev/null || true
