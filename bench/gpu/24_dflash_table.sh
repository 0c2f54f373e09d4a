#!/usr/bin/env bash
# Issue 4's table on the H200 with the shipped (or DRAFT=...) draft: DFlash against plain decoding
# at spec_len 4, 8 and 16, every expert on the GPU and half of them, on long-form continuations
# (400 new tokens) and HumanEval prompts, in float32 (greedy identity is exact there:
# bench/dflash_lossless.py) with graph decoding and graph verify blocks where the placement
# allows them (all experts hot); the 50% rows run eagerly with their cold experts on the CPU, or,
# with COLD_DEVICE=gpu, from the captured steps with the GPU reading the cold experts over the bus.
source "$(dirname "$0")/env.sh"
python3 -c "from engine.train.corpus import build_corpus; build_corpus('/tmp/corpus', n_retrieval=0)" > /dev/null
timeout ${DFLASH_S:-500} python3 bench/dflash.py --target models/luce-target.gguf --draft ${DRAFT:-models/luce-draft.gguf} \
  --corpus /tmp/corpus/held_out.txt --dtype float32 --graph --spec-lens 4,8,16 --budgets ${BUDGETS:-all,50%} \
  --rollbacks capture --cold-device ${COLD_DEVICE:-cpu} --long-form ${LONG:-2} --code ${CODE:-2} --new-tokens 400 \
  --json "$OUT/dflash_table.json" 2>&1 | tee "$OUT/dflash_table.log" | grep -v Warn || echo "table rc=$?"
