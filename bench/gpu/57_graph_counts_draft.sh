#!/usr/bin/env bash
# Issues 9 and 4 in one call. Starts the llama-bench build (carry .snap) and the Q4_0 35B file, and a
# draft on distilled rows as long as issue 4's table reads (DISTILL_PROMPT=512 + DISTILL_NEW=448,
# DISTILL_N rows, DRAFT_MINUTES of training) in the background; beside them the captured steps' CUDA
# tests with the expert pairs counted on the host (the decode graph, the engine's graph decoding with a
# hybrid placement, the padded prefill graph, cold experts on the device); then waits for the draft
# (WAIT_S) and copies it, its log and its held-out report to $OUT. 18_vs_llamacpp.sh follows (WAIT_S=30).
source "$(dirname "$0")/env.sh"
bash "$(dirname "$0")/17_llamacpp_build.sh"
start_q35
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
rm -rf /tmp/draft; mkdir -p /tmp/draft
t0=$(date +%s)
setsid nohup python3 -m tuner.cli train-draft --target models/luce-target.gguf --corpus /tmp/corpus/train.txt \
  --out /tmp/draft/luce-draft.gguf --layers 3 --features 3 --block-size 16 --batch 16 --anchors 256 --lr 2e-3 \
  --distill ${DISTILL_N:-8192} --distill-prompt ${DISTILL_PROMPT:-512} --distill-new ${DISTILL_NEW:-448} \
  --distill-batch ${DISTILL_BATCH:-1024} --eval-prompt-tokens ${EVAL_PROMPT:-512} \
  --steps ${DRAFT_STEPS:-6144} --time-budget ${DRAFT_MINUTES:-4}m ${HELD_OUT:+--held-out $HELD_OUT} --device cuda \
  > /tmp/draft/train.log 2>&1 &
echo "draft training started"
timeout ${TESTS_S:-200} python3 -m pytest -m gpu -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/test_engine_decode_graph.py tests/engine/model/test_prefill_graph.py \
  tests/engine/test_hybrid_cold_device.py tests/engine/model/test_decode_graph.py > "$OUT/tests.log" 2>&1 \
  || echo "tests rc=$?"
tests_summary $t0
while pgrep -f "tuner.cli train-draft" > /dev/null && [ $(( $(date +%s) - t0 )) -lt ${WAIT_S:-540} ]; do sleep 5; done
echo "draft run $(( $(date +%s) - t0 )) s"
tail -c 2000 /tmp/draft/train.log | tr '\r' '\n' | grep -v "^$" | tail -8 || true
cp /tmp/draft/luce-draft.gguf /tmp/draft/luce-draft.acceptance.json /tmp/draft/train.log "$OUT"/ 2>/dev/null || true
tail -3 /tmp/llbuild/build.log 2>/dev/null || true
