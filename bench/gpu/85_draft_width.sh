#!/usr/bin/env bash
# Issue 4, first of two calls on one warm machine: a draft whose layers read the target's features through as
# many key/value heads as they have query heads (KV_HEADS, default 4; the drafts so far had 1, so each layer saw
# the context through one head of 64 values), on more distilled rows (DISTILL_N, default 12,288 of 512 + 448
# tokens; the 8192x960 draft had 8,192) and trained longer (DRAFT_MINUTES, default 5; it had 4), 57's recipe
# otherwise, reported on the standard library's held-out files. Training runs in the background and outlives
# this call; beside it the llama-bench build (carry .snap) and the 35B file start for 87, and the DFlash CUDA
# tests run (81's selection, TESTS_S). 86 follows at once on the warm machine: it waits for the draft.
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
rm -rf /tmp/draft; mkdir -p /tmp/draft
setsid nohup python3 -m tuner.cli train-draft --target models/luce-target.gguf --corpus /tmp/corpus/train.txt \
  --held-out /tmp/corpus/held_out.txt --out /tmp/draft/luce-draft.gguf --layers ${LAYERS:-3} --features 3 \
  --kv-heads ${KV_HEADS:-4} --block-size 16 --batch 16 --anchors 256 --lr 2e-3 --distill ${DISTILL_N:-12288} \
  --distill-prompt 512 --distill-new 448 --distill-batch 1024 --eval-prompt-tokens 512 --steps ${DRAFT_STEPS:-8192} \
  --time-budget ${DRAFT_MINUTES:-5}m --device cuda > /tmp/draft/train.log 2>&1 &
echo "draft training started"
dflash_tests
tail -c 1500 /tmp/draft/train.log | tr '\r' '\n' | grep -v "^$" | tail -4 || true
[ -z "$maker" ] || echo "35B file: $(ls -la /tmp/q35*.gguf 2>/dev/null)"
tail -2 /tmp/llbuild/build.log 2>/dev/null || true
