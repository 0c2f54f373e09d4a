#!/usr/bin/env bash
# Issue 4, first of two calls: where a DFlash step's time goes with the shipped draft
# (bench/dflash_step.py: each captured graph timed alone against the step's wall time), then a
# draft trained in the background on 4x more distilled prompts (4,096 x 256 new tokens) while the
# in-cache draft step and the captured plain stretches are tested on CUDA. 31_dflash_table.sh,
# in the next call on the warm machine, waits for that draft and runs issue 4's table with it.
source "$(dirname "$0")/env.sh"
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
t0=$(date +%s)
timeout ${STEP_S:-150} python3 bench/dflash_step.py --target models/luce-target.gguf --draft models/luce-draft.gguf \
  --corpus /tmp/corpus/held_out.txt --json "$OUT/dflash_step_shipped.json" 2>&1 | grep -v Warn \
  | tee "$OUT/dflash_step_shipped.log" || echo "step bench rc=$?"
echo "step bench $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/draft
setsid nohup python3 -m tuner.cli train-draft --target models/luce-target.gguf --corpus /tmp/corpus/train.txt \
  --out /tmp/draft/luce-draft.gguf --layers 3 --features 3 --block-size 16 --batch 16 --anchors 256 --lr 2e-3 \
  --distill ${DISTILL_N:-4096} --distill-prompt 64 --distill-new ${DISTILL_NEW:-256} --distill-batch 1024 \
  --steps ${DRAFT_STEPS:-2000} --time-budget ${DRAFT_MINUTES:-4}m --device cuda > /tmp/draft/train.log 2>&1 &
echo "draft training started (pid $!)"
if [ -f .snap/llama-src.tar.xz ]; then bash "$(dirname "$0")/17_llamacpp_build.sh" | tail -2; fi
t1=$(date +%s)
timeout ${TESTS_S:-150} python3 -m pytest -o addopts="" -q --tb=short -p no:cacheprovider \
  tests/engine/dflash/test_draft.py tests/engine/dflash/test_gpu.py > "$OUT/tests.log" 2>&1 || echo "tests rc=$?"
echo "tests $(( $(date +%s) - t1 )) s"; grep -E "passed|failed|^FAILED|Error" "$OUT/tests.log" | tail -8 || true
tail -c 600 /tmp/draft/train.log | tr '\r' '\n' | tail -3 || true
